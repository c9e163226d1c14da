"""The retrieval report (queries, ranked results, the explanation) as readable tables."""

from __future__ import annotations

from typing import Any


def format_report(report: dict[str, Any]) -> str:
    """The report as readable tables."""
    lines = [f"model {report['model']}: {report['images']} images, {report['sentences']} "
             f"sentences indexed in {report['index_dir']}"]
    for query in report["queries"]:
        if query["kind"] == "sentence":
            lines += ["", f"{query['query']!r} ({query['fragments']} fragments) -> images",
                      f"{'rank':>4}  {'score':>8}  image"]
            lines += [f"{r['rank']:>4}  {r['score']:8.4f}  {r['image']}" for r in query["results"]]
        else:
            lines += ["", f"{query['query']} ({query['boxes']} boxes) -> sentences",
                      f"{'rank':>4}  {'score':>8}  {'line':>5}  sentence"]
            lines += [f"{r['rank']:>4}  {r['score']:8.4f}  {r['line']:>5}  {r['sentence']}"
                      for r in query["results"]]
    if "explain" in report:
        explained = report["explain"]
        lines += ["", f"explain {explained['sentence']!r} on {explained['image']} -> "
                      f"{explained['picture']}",
                  f"{'fragment':<32} {'box':>3}  {'score':>7}  box xyxy (pixels)"]
        lines += [f"{f['fragment']:<32} {f['box']:>3}  {f['score']:7.3f}  {f['xyxy']}"
                  for f in explained["fragments"]]
    return "\n".join(lines)
