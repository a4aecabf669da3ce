"""The session report as one self-contained HTML page.

``render_page(session)`` turns the plugin's session record (a JSON-able dict: a summary and,
per test, its outcome, reproduce command, failure text and per-rank spans) into one page with
inline CSS, JS and SVG that loads nothing from anywhere: it can be mailed, kept as a CI
artifact or opened offline. Per test it draws a rank timeline - a lane per rank, phase bars
coloured by outcome, collective bars above them, the first failure marked - beside the
reproduce command, the hang view, the failure text, each rank's output and links to each rank's
log and the job's trace (relative, set by :mod:`.reportfiles`); above the tests, the session's
environment and a search box over names, outcomes and messages. ``render_test(test)``
is one test's part alone, its style scoped to it (for pytest-html's extras).

Every value from the record is escaped; any key but a test's ``nodeid`` and ``outcome`` may be
missing or None. With JS off the page shows everything; JS only adds the outcome filters and the search.
No pytest import.
"""

from __future__ import annotations

import html
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pytest_msrun.cpulist import format_id_list

OUTCOMES = ("failed", "error", "xpassed", "xfailed", "skipped", "passed")
WIDTH, LABEL_W, RIGHT = 1000.0, 200.0, 12.0  # SVG user units
LANE_MAX, LANE_MIN, LANES_H = 28.0, 1.0, 1400.0  # lane height: capped, shrinks to fit LANES_H
TOP, AXIS_H = 6.0, 30.0
LABEL_PX = 14.0  # the least room a label gets: denser lanes label every k-th rank

_CSS = """
&{--ink:#1f2328;--mute:#59636e;--line:#d1d9e0;--soft:#f6f8fa;--red:#cf222e;color:var(--ink);
font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,Arial,sans-serif}
.passed,[data-outcome=passed]{--c:#1a7f37;--bg:#dafbe1}.failed,[data-outcome=failed]{--c:var(--red);--bg:#ffebe9}
.error,[data-outcome=error]{--c:#a40e26;--bg:#ffebe9}.skipped,[data-outcome=skipped]{--c:#bf8700;--bg:#fff8c5}
.xpassed,[data-outcome=xpassed]{--c:#0969da;--bg:#ddf4ff}.xfailed,.other{--c:#6e7781;--bg:#eff2f5}.coll{--c:#8250df}
.coll.late{--c:#e16f24}*{box-sizing:border-box}[hidden]{display:none!important}.muted{color:var(--mute)}
h1{font-size:22px;margin:0 0 4px}h2{font-size:15px;margin:0;word-break:break-all}
pre,code,.nodeid,svg text{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace}
pre{font-size:12.5px;background:var(--soft);border:1px solid var(--line);border-radius:6px;padding:8px 12px;
margin:8px 0;overflow:auto;max-height:520px;white-space:pre-wrap;word-break:break-all}
header.page{border-bottom:1px solid var(--line);padding-bottom:14px;margin-bottom:14px}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:10px 0}dt{color:var(--mute)}
dd{margin:0}details{margin:6px 0}summary{cursor:pointer;color:var(--mute)}summary code{color:var(--ink)}
.badge{display:inline-block;padding:0 8px;border-radius:10px;font-size:12px;font-weight:600;white-space:nowrap;
border:1px solid currentColor;color:var(--c);background:var(--bg)}
nav.filters{display:flex;flex-wrap:wrap;gap:6px;align-items:center;margin:10px 0}
button.filter{font:inherit;font-size:13px;cursor:pointer;border:1px solid var(--line);background:#fff;
border-radius:6px;padding:2px 10px;color:var(--c,var(--ink))}
button.filter[aria-pressed=false]{opacity:.45;text-decoration:line-through}
.legend{display:flex;flex-wrap:wrap;gap:14px;font-size:12px;color:var(--mute)}
.legend i{display:inline-block;width:14px;height:9px;border-radius:2px;margin-right:5px;background:var(--c)}
section.msrun-test{border:1px solid var(--line);border-left:5px solid var(--c,#8c959f);border-radius:6px;
padding:12px 16px;margin:16px 0}
.test-head{display:flex;gap:10px;align-items:baseline;flex-wrap:wrap}.message{margin:6px 0}
.first-failure-text{color:var(--red);font-weight:600;margin:6px 0}
svg.timeline{display:block;width:100%;height:auto;margin:8px 0}svg text{font-size:11px;fill:var(--ink)}
svg .tick text{fill:var(--mute);font-size:10px}.tick line{stroke:#e4e8ec}.bar{fill:var(--c)}.stripe{fill:var(--soft)}
.lane.failing .stripe{fill:#ffebe9}svg text.bar-label{fill:#fff;font-size:10px}
.lane.failing text.label{fill:var(--red);font-weight:700}.mark line{stroke:var(--ink);stroke-width:1.5}
.first-failure line{stroke:var(--red);stroke-dasharray:4 3}.first-failure path{fill:var(--red);stroke:#fff}
.links{margin:4px 0;font-size:13px}.links a{margin-right:8px}input.search{font:inherit;font-size:13px;
border:1px solid var(--line);border-radius:6px;padding:2px 8px;min-width:260px;margin-left:auto}
"""
_PAGE_CSS = "body{margin:0}main{max-width:1120px;margin:0 auto;padding:24px 28px 48px}"
_JS = r"""
const buttons = [...document.querySelectorAll("button.filter")], off = new Set();
const search = document.getElementById("msrun-search"), count = document.getElementById("msrun-shown");
function apply() {
  const terms = (search ? search.value : "").toLowerCase().split(/\s+/).filter(Boolean);
  const tests = [...document.querySelectorAll("section.msrun-test")];
  for (const s of tests) {
    const text = s.dataset.search || "";
    s.hidden = off.has(s.dataset.outcome) || !terms.every((t) => text.includes(t));
  }
  for (const b of buttons) b.setAttribute("aria-pressed", String(!off.has(b.dataset.outcome)));
  if (count) count.textContent = `${tests.filter((s) => !s.hidden).length} of ${tests.length} shown`;
}
if (search) search.addEventListener("input", apply);
for (const b of buttons) b.addEventListener("click", () => {
  const o = b.dataset.outcome;
  if (o === "*") off.clear(); else if (off.has(o)) off.delete(o); else off.add(o);
  apply();
});
apply();
document.body.dataset.ready = "1";
"""


def _scoped(css: str) -> str:
    """``css`` with each selector limited to the inside of ``.msrun`` (``&``: that element)."""
    rules = [rule.split("{", 1) for rule in css.replace("\n", "").split("}") if rule.strip()]
    scope = [(",".join(".msrun" if s == "&" else f".msrun {s}" for s in sel.split(",")), body) for sel, body in rules]
    return "\n".join(f"{sel}{{{body}}}" for sel, body in scope)


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _secs(value: object) -> str:
    s = _num(value)
    if s is None:
        return "?"
    return f"{s * 1000:.0f} ms" if abs(s) < 1 else f"{s:.2f} s"


def _rel(href: object) -> str:
    """A relative link into the page's folder, or "" (no scheme, no absolute path, no way up)."""
    if not isinstance(href, str) or not re.fullmatch(r"[A-Za-z0-9._~%/-]+", href) or href.startswith("/"):
        return ""
    return "" if ".." in href.split("/") else href


def _search_text(test: dict[str, Any]) -> str:
    """What the search box matches a test by: its node id, outcome, messages (lower case)."""
    ff = _dict(test.get("first_failure"))
    parts = [test.get("nodeid"), test.get("outcome"), test.get("message"), ff.get("error")]
    return " ".join(str(p) for p in parts if p).lower()


def _links(test: dict[str, Any], ranks: list[dict[str, Any]]) -> str:
    """The test's trace and each rank's log, linked relative to the page."""
    out = []
    trace = _rel(test.get("trace_href"))
    if trace:
        out.append(f'trace: <a class="trace-link" href="{_e(trace)}">{_e(trace.rsplit("/", 1)[-1])}</a>')
    logs = [
        f'<a class="log-link" data-rank="{_e(r.get("rank", i))}" href="{_e(_rel(r.get("log_href")))}">'
        f"rank {_e(r.get('rank', i))}</a>"
        for i, r in enumerate(ranks)
        if _rel(r.get("log_href"))
    ]
    if logs:
        out.append("logs: " + "".join(logs))
    return f'<p class="links">{" · ".join(out)}</p>' if out else ""


def _cls(outcome: object) -> str:
    return outcome if isinstance(outcome, str) and outcome in OUTCOMES else "other"


def _u(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _ranks(ids: Iterable[object]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5`` (what is not a rank left out)."""
    return format_id_list(i for i in ids if type(i) is int)


def _times(test: dict[str, Any]) -> list[float]:
    found = [_num(_dict(test.get("first_failure")).get("at"))]
    for rank in _list(test.get("ranks")):
        for span in _list(_dict(rank).get("spans")):
            found += [_num(_dict(span).get("start")), _num(_dict(span).get("end"))]
        found += [_num(_dict(mark).get("at")) for mark in _list(_dict(rank).get("marks"))]
    return [t for t in found if t is not None]


def _window(test: dict[str, Any]) -> tuple[float, float] | None:
    """The test's window (t0, t1): as recorded, else derived from its spans and marks."""
    t0, t1 = _num(test.get("t0")), _num(test.get("t1"))
    times = (_times(test) if t0 is None or t1 is None else []) + [t for t in (t0, t1) if t is not None]
    if not times:
        return None
    t0, t1 = min(times) if t0 is None else t0, max(times) if t1 is None else t1
    return t0, max(t0, t1)


def _ticks(span: float) -> list[float]:
    raw = span / 6
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(span / step + 1e-9) + 1)]


def _label(rank: dict[str, Any]) -> str:
    where = ", ".join(str(v) for v in (rank.get("host"), rank.get("pid")) if v not in (None, ""))
    return f"rank {rank.get('rank', '?')}" + (f" ({where})" if where else "")


def _bars(rank: dict[str, Any], r: object, y: float, lane: float, x: Callable[[float], float]) -> Iterator[str]:
    """One lane's bars: collectives in a thin strip on top, phases below, then the marks."""
    coll_y, coll_h, bar_y, bar_h = y + lane * 0.1, lane * 0.22, y + lane * 0.37, lane * 0.53
    if lane < 4:  # dense: phases fill the lane, collectives cover its upper half
        coll_y, coll_h, bar_y, bar_h = y, lane / 2, y, lane
    spans = sorted(map(_dict, _list(rank.get("spans"))), key=lambda s: s.get("kind") == "collective")
    for s in spans:
        start, end = _num(s.get("start")), _num(s.get("end"))
        start = end if start is None else start
        if start is None:
            continue
        end = start if end is None or end < start else end
        sx, w, name, dur = x(start), max(x(end) - x(start), 1.0), s.get("name", "span"), _secs(end - start)
        if s.get("kind") == "collective":
            waited = _list(s.get("waited_for"))
            tip = f"{name}: {dur}" + (f", waited for rank {_ranks(waited)}" if _ranks(waited) else "")
            yield (
                f'<rect class="bar coll{" late" if r in waited else ""}" x="{_u(sx)}" y="{_u(coll_y)}" '
                f'width="{_u(w)}" height="{_u(coll_h)}"><title>{_e(tip)}</title></rect>'
            )
            continue
        tip = f"{name}: {s.get('outcome') or '?'}, {dur}"
        yield (
            f'<rect class="bar phase {_cls(s.get("outcome"))}" x="{_u(sx)}" y="{_u(bar_y)}" width="{_u(w)}" '
            f'height="{_u(bar_h)}"><title>{_e(tip)}</title></rect>'
        )
        if w >= 7 * len(str(name)) + 8 and bar_h >= 10:
            yield f'<text class="bar-label" x="{_u(sx + 4)}" y="{_u(bar_y + bar_h / 2 + 3.5)}">{_e(name)}</text>'
    for m in map(_dict, _list(rank.get("marks"))):
        at = _num(m.get("at"))
        if at is not None:
            tip = f"{m.get('name', 'mark')}: {m.get('text', '')}"
            yield (
                f'<g class="mark"><title>{_e(tip)}</title>'
                f'<line x1="{_u(x(at))}" y1="{_u(y)}" x2="{_u(x(at))}" y2="{_u(y + lane)}"/></g>'
            )


def _timeline(test: dict[str, Any], ranks: list[dict[str, Any]], window: tuple[float, float], timed: bool) -> str:
    """The SVG: a lane per rank (height shrinks with the rank count), an axis in seconds from t0."""
    t0, t1 = window
    span = t1 - t0 if math.isfinite(t1 - t0) and t1 - t0 > 1e-9 else 1.0
    pw = WIDTH - LABEL_W - RIGHT
    lane = max(LANE_MIN, min(LANE_MAX, LANES_H / len(ranks)))
    every = math.ceil(LABEL_PX / lane)  # dense lanes: a label every k-th rank (all have a <title>)
    bottom = TOP + lane * len(ranks)
    ff = _dict(test.get("first_failure"))

    def x(t: float) -> float:
        r = (t - t0) / span
        r = r if math.isfinite(r) else (1.0 if r > 0 else 0.0)
        return LABEL_W + min(max(r, 0.0), 1.0) * pw

    crisp = ' shape-rendering="crispEdges"' if lane < 4 else ""  # no seams between dense lanes
    out = [f'<svg class="timeline" viewBox="0 0 {_u(WIDTH)} {_u(bottom + AXIS_H)}" role="img"{crisp}>']
    for t in _ticks(span) if timed else []:
        tx = _u(LABEL_W + t / span * pw)
        out.append(
            f'<g class="tick"><line x1="{tx}" y1="{_u(TOP)}" x2="{tx}" y2="{_u(bottom + 4)}"/>'
            f'<text x="{tx}" y="{_u(bottom + 16)}" text-anchor="middle">{round(t, 9):g} s</text></g>'
        )
    ids = [rank.get("rank", i) for i, rank in enumerate(ranks)]
    ff_i = ids.index(ff["rank"]) if type(ff.get("rank")) is int and ff["rank"] in ids else None
    for i, rank in enumerate(ranks):
        y, r, failing = TOP + i * lane, ids[i], i == ff_i
        label = _e(_label(rank))
        out.append(f'<g class="lane{" failing" if failing else ""}" data-rank="{_e(r)}"><title>{label}</title>')
        if (len(ranks) <= 64 and i % 2 == 0) or failing:
            out.append(f'<rect class="stripe" x="0" y="{_u(y)}" width="{_u(WIDTH)}" height="{_u(lane)}"/>')
        if (i % every == 0 and (ff_i is None or abs(i - ff_i) >= every)) or failing:
            size = min(11.0, max(lane, LABEL_PX) * 0.75)
            out.append(
                f'<text class="label" x="6" y="{_u(y + lane / 2 + size * 0.35)}" font-size="{_u(size)}">{label}</text>'
            )
        out += _bars(rank, r, y, lane, x)
        out.append("</g>")
    if ff_i is not None:
        at = _num(ff.get("at"))
        fx, cy, d = _u(x(t1 if at is None else at)), TOP + (ff_i + 0.5) * lane, max(3.0, min(7.0, lane / 2))
        out.append(
            f'<g class="first-failure"><title>{_e(ff.get("error"))}</title>'
            f'<line x1="{fx}" y1="{_u(TOP)}" x2="{fx}" y2="{_u(bottom)}"/>'
            f'<path d="M{fx} {_u(cy - d)}l{_u(d)} {_u(d)}l{_u(-d)} {_u(d)}l{_u(-d)} {_u(-d)}Z"/></g>'
        )
    out.append("</svg>")
    return "".join(out)


def _test(test: dict[str, Any]) -> str:
    outcome = test.get("outcome")
    ranks = [_dict(r) for r in _list(test.get("ranks"))]
    meta = [_secs(test["duration"])] if _num(test.get("duration")) is not None else []
    if test.get("worker_num") is not None:
        meta.append(f"{test['worker_num']} ranks")
    if test.get("mode"):
        meta.append(f"{test['mode']} world")
    out = [
        f'<section class="msrun-test" data-nodeid="{_e(test.get("nodeid"))}" data-outcome="{_e(outcome)}" '
        f'data-search="{_e(_search_text(test))}">',
        f'<div class="test-head"><span class="badge {_cls(outcome)}">{_e(outcome)}</span>'
        f'<h2 class="nodeid">{_e(test.get("nodeid"))}</h2><span class="muted">{_e(" · ".join(meta))}</span></div>',
    ]
    links = _links(test, ranks)
    if links:
        out.append(links)
    if test.get("message"):
        out.append(f'<p class="message">{_e(test["message"])}</p>')
    ff = _dict(test.get("first_failure"))
    if ff:
        phase = f" in {ff['phase']}" if ff.get("phase") else ""
        text = f"first failure: rank {ff.get('rank', '?')}{phase}: {ff.get('error') or '?'}"
        out.append(f'<p class="first-failure-text">{_e(text)}</p>')
    if test.get("reproduce"):
        out.append(f'<pre class="reproduce">{_e(test["reproduce"])}</pre>')
    window = _window(test)
    if window is None:
        out.append(f'<p class="muted no-timeline">{"no timing recorded" if ranks else "no ranks launched"}</p>')
    if ranks:
        out.append(_timeline(test, ranks, window or (0.0, 0.0), window is not None))
    if test.get("hang"):
        out.append(f'<pre class="hang">{_e(test["hang"])}</pre>')
    if test.get("longrepr"):
        out.append(
            f'<details class="longrepr"><summary>failure details</summary><pre>{_e(test["longrepr"])}</pre></details>'
        )
    for i, rank in enumerate(ranks):
        log = f" · log <code>{_e(rank['log'])}</code>" if rank.get("log") else ""
        out.append(
            f'<details class="rank-output" data-rank="{_e(rank.get("rank", i))}"><summary>{_e(_label(rank))} · '
            f"{_e(rank.get('outcome') or '?')}{log}</summary>"
            f"<pre>{_e(rank.get('output') or '(no output)')}</pre></details>"
        )
    out.append("</section>")
    return "\n".join(out)


def _header(session: dict[str, Any], tests: list[dict[str, Any]]) -> str:
    summary = _dict(session.get("summary"))
    recorded = {str(k): v for k, v in _dict(summary.get("outcomes")).items() if isinstance(v, int)}
    counts = recorded or dict(Counter(str(t.get("outcome")) for t in tests))
    order = [o for o in OUTCOMES if o in counts] + sorted(o for o in counts if o not in OUTCOMES)
    badges = " ".join(f'<span class="badge {_cls(o)}">{counts[o]} {_e(o)}</span>' for o in order)
    total, phases = summary.get("tests"), _dict(summary.get("phase_seconds"))
    facts = {  # the empty ones are left out
        "tests": f"{_e(len(tests) if total is None else total)} {badges}",
        "duration": _e(_secs(summary["duration"])) if _num(summary.get("duration")) is not None else "",
        "worlds started": _e(summary.get("worlds_started")),
        "time per phase": _e(" · ".join(f"{k} {_secs(v)}" for k, v in phases.items())),
        "generated": _e(session.get("generated")),
        "command": f"<code>{_e(session['command'])}</code>" if session.get("command") else "",
    }
    buttons = "".join(
        f'<button type="button" class="filter" data-outcome="{_e(o)}" aria-pressed="true">'
        f"{_e(o)} ({counts[o]})</button>"
        for o in order
    )
    swatches = {"passed": "passed", "failed": "failed", "skipped": "skipped", "coll": "collective"}
    swatches["coll late"] = "collective this rank was waited for"
    legend = "".join(f'<span><i class="{c}"></i>{n}</span>' for c, n in swatches.items())
    env = _dict(session.get("environment"))
    environment = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in env.items() if v not in (None, ""))
    if environment:
        environment = (
            f'<details class="environment"><summary>environment</summary><dl class="facts">{environment}</dl></details>'
        )
    return (
        f'<header class="page"><h1>{_e(session.get("title") or "msrun test report")}</h1>'
        f'<dl class="facts">{"".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts.items() if v)}</dl>'
        f"{environment}"
        f'<nav class="filters"><span class="muted">show:</span>'
        f'<button type="button" class="filter" data-outcome="*" aria-pressed="true">all</button>{buttons}'
        '<input type="search" class="search" id="msrun-search" placeholder="search tests, outcomes, messages" '
        'aria-label="search tests"><span class="muted" id="msrun-shown"></span></nav>'
        f'<div class="legend">{legend}<span>&#9670; first failure</span></div></header>'
    )


def render_page(session: dict[str, Any]) -> str:
    """The whole report: one HTML document that references nothing outside itself."""
    session = _dict(session)
    tests = [_dict(t) for t in _list(session.get("tests"))]
    body = "\n".join(map(_test, tests)) or '<p class="muted">no tests</p>'
    csp = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(session.get('title') or 'msrun test report')}</title>"
        f"<style>{_PAGE_CSS}\n{_scoped(_CSS)}</style></head>\n"
        f'<body><main class="msrun">{_header(session, tests)}\n{body}\n</main>'
        f"<script>{_JS}</script></body></html>\n"
    )


def render_test(test: dict[str, Any]) -> str:
    """One test's section as an HTML fragment with its own (scoped) style, for pytest-html's extras."""
    return f'<div class="msrun"><style>{_scoped(_CSS)}</style>{_test(_dict(test))}</div>'
