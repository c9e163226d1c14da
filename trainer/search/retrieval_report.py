"""The retrieval report (queries, ranked results, the explanation) as readable tables."""

from __future__ import annotations

from typing import Any


def format_report(report: dict[str, Any]) -> str:
    """The report as readable tables."""
    lines = [f"model {report['model']}: {report['images']} images, {report['sentences']} "
             f"sentences indexed in {report['index_dir']}"]
    for query in report["queries"]:
        if query["kind"] == "image":
            lines += ["", f"{query['query']} ({query['boxes']} boxes) -> sentences"
                          f"{_proof(query)}", f"{'rank':>4}  {'score':>8}  {'line':>5}  sentence"]
            lines += [f"{r['rank']:>4}  {r['score']:8.4f}  {r['line']:>5}  {r['sentence']}"
                      for r in query["results"]]
        elif query["kind"] == "sentence":
            unit = "words" if "words" in query else "fragments"
            lines += ["", f"{query['query']!r} ({query[unit]} {unit}) -> images{_proof(query)}",
                      *_image_rows(query["results"])]
        else:  # arithmetic
            own = query["query_image_rank"]
            lines += ["", f"{query['query']} ({query['boxes']} boxes; eq. 15 cosine) -> images",
                      *_image_rows(query["results"]),
                      f"the query image itself ranks {own} of {report['images']}" if own
                      else "the query image is not among the --images"]
    if "explain" in report:
        explained = report["explain"]
        lines += ["", f"explain {explained['sentence']!r} on {explained['image']} -> "
                      f"{explained['picture']}"]
        if "words" in explained:
            lines.append(f"{'word':<20} {'contribution':>12}")
            lines += [f"{w['word']:<20} {w['contribution']:12.4f}" if w["contribution"] is not None
                      else f"{w['word']:<20} {'(not in the vocabulary)':>12}"
                      for w in explained["words"]]
        else:
            lines.append(f"{'fragment':<32} {'box':>3}  {'score':>7}  box xyxy (pixels)")
            lines += [f"{f['fragment']:<32} {f['box']:>3}  {f['score']:7.3f}  {f['xyxy']}"
                      for f in explained["fragments"]]
    return "\n".join(lines)


def _proof(query: dict[str, Any]) -> str:
    """What an index search proved of its top k ("" for a scan of --images / --sentences)."""
    if "exact" not in query:
        return ""
    if query["exact"]:
        return f" (exact: proven, {query['scored']} items scored)"
    return (f" (NOT proven exact: the bound is {query['gap']:.4g} above the last score; raise "
            "--budget-s, or --exact-scan)")


def _image_rows(results: list[dict[str, Any]]) -> list[str]:
    """A ranked-images table."""
    return [f"{'rank':>4}  {'score':>8}  image",
            *(f"{r['rank']:>4}  {r['score']:8.4f}  {r['image']}" for r in results)]
