// The search page: talks to the JSON API of trainer/search/serve.py (docs/search-app.md) and shows its
// answers; an API error is shown in the page (#error), never left as an exception.
"use strict";

const $ = (id) => document.getElementById(id);
let latest = { images: 0, sentences: 0 };  // the newest request of each panel wins

// The JSON answer of `url`, or an Error whose message is the API's one-line error.
async function api(url, options) {
  let response;
  try {
    response = await fetch(url, options);
  } catch (err) {
    throw new Error(`cannot reach the search server (${err.message})`);
  }
  const body = await response.json().catch(() => null);
  if (!response.ok) {
    throw new Error(body && body.error ? body.error : `${response.status} ${response.statusText}`);
  }
  return body;
}

// Run an action of the page; its failure becomes the message in #error.
async function attempt(action, busy) {
  $("error").hidden = true;
  $("status").textContent = busy;
  try {
    await action();
  } catch (err) {
    $("error").textContent = err.message;
    $("error").hidden = false;
  } finally {
    $("status").textContent = "";
  }
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const score = (value) => value.toFixed(3);

// Whether a search proved its results to be the model's exact top k (docs/design.md,
// "Certified search"), in words.
const proof = (answer) => answer.exact
  ? `Exact top ${answer.results.length}: proven (${answer.scored} scored by the model)`
  : `Not proven exact: the bound is ${answer.gap.toPrecision(3)} above the last score`;

async function showInfo() {
  const info = await api("/api/info");
  $("query").maxLength = info.max_query_chars;
  const model = info.model.split("/").filter(Boolean).slice(-2).join("/");
  $("info").textContent = `${info.images} photos · ${info.sentences} sentences · model ${model}`;
  if (!info.sentences) {
    $("upload").disabled = true;
    $("upload").title = "this index has no sentences";
  }
}

async function searchImages(query, k) {
  const ticket = ++latest.images;
  const params = new URLSearchParams({ q: query, k: String(k) });
  const answer = await api(`/api/search?${params}`);
  if (ticket !== latest.images) return;
  $("images-title").textContent = `Photos for “${answer.query}”`;
  $("images-proof").textContent = proof(answer);
  const grid = $("grid");
  grid.replaceChildren(...answer.results.map((hit) => imageCard(answer.query, hit)));
  $("images").hidden = false;
}

function imageCard(query, hit) {
  const card = element("li", "card");
  const open = element("button", "thumb");
  open.type = "button";
  open.title = "Why does this photo match?";
  const img = element("img");
  img.src = hit.url;
  img.alt = hit.image;
  open.append(img);
  open.addEventListener("click", () => attempt(() => explain(query, hit.image), "Explaining…"));
  const meta = element("div", "meta");
  meta.append(element("span", "rank", `#${hit.rank}`), element("span", "score", score(hit.score)));
  const similar = element("button", "link", "similar sentences");
  similar.type = "button";
  similar.addEventListener("click", () => attempt(() => sentencesForImage(hit), "Searching…"));
  card.append(open, meta, element("div", "name", hit.image), similar);
  return card;
}

async function sentencesForImage(hit) {
  const ticket = ++latest.sentences;
  const params = new URLSearchParams({ image: hit.image, k: $("count").value });
  const answer = await api(`/api/sentences?${params}`);
  if (ticket !== latest.sentences) return;
  showSentences(`Sentences for ${hit.image}`, hit.url, answer, hit.image);
}

async function sentencesForUpload(file) {
  const ticket = ++latest.sentences;
  const answer = await api(`/api/sentences?k=${$("count").value}`, {
    method: "POST",
    headers: { "Content-Type": file.type || "application/octet-stream" },
    body: file,
  });
  if (ticket !== latest.sentences) return;
  showSentences(`Sentences for your photo ${file.name}`, URL.createObjectURL(file),
                answer, null);
}

// The sentence results; `indexed` (an image name, or null for an upload) can be explained.
function showSentences(title, src, answer, indexed) {
  $("sentences-title").textContent = title;
  $("sentences-proof").textContent = proof(answer);
  $("sentences-image").src = src;
  $("sentence-list").replaceChildren(...answer.results.map((hit) => {
    const item = element("li");
    item.append(element("span", "score", score(hit.score)), element("span", "text", hit.sentence));
    if (indexed) {
      const why = element("button", "link", "why?");
      why.type = "button";
      why.addEventListener("click", () => attempt(() => explain(hit.sentence, indexed),
                                                  "Explaining…"));
      item.append(why);
    }
    return item;
  }));
  $("sentences").hidden = false;
  $("sentences").scrollIntoView({ behavior: "smooth", block: "nearest" });
}

// Figure 4 for a sentence and an indexed image: the picture and what it shows.
async function explain(sentence, image) {
  const params = new URLSearchParams({ q: sentence, image });
  const details = await api(`/api/explain?${params}&format=json`);
  $("explain-title").textContent = `Why ${image} matches`;
  $("explain-sentence").textContent = `“${details.sentence}”`;
  $("explain-image").src = `/api/explain?${params}`;
  const [head, rows] = details.fragments
    ? [["sentence fragment", "best box", "box (x1, y1, x2, y2)", "score"],
       details.fragments.map((f) => [f.fragment, f.box, f.xyxy.join(", "), score(f.score)])]
    : [["word", "contribution to the score"],
       details.words.map((w) => [w.word, w.contribution === null ? "not in the vocabulary"
                                                                 : score(w.contribution)])];
  const table = $("explain-details");
  table.tHead.replaceChildren(row("th", head));
  table.tBodies[0].replaceChildren(...rows.map((cells) => row("td", cells)));
  $("explain").showModal();
}

function row(cell, values) {
  const tr = element("tr");
  tr.append(...values.map((value) => element(cell, "", String(value))));
  return tr;
}

document.addEventListener("DOMContentLoaded", () => {
  attempt(showInfo, "Loading…");
  $("search-form").addEventListener("submit", (event) => {
    event.preventDefault();
    attempt(() => searchImages($("query").value, $("count").value), "Searching…");
  });
  $("upload").addEventListener("change", () => {
    const file = $("upload").files[0];
    if (file) attempt(() => sentencesForUpload(file), "Reading your photo…");
  });
  $("explain").addEventListener("click", (event) => {  // a click outside the dialog closes it
    if (event.target === $("explain")) $("explain").close();
  });
});
