"""The charts block of the status page and of ``echo2 hub report``'s HTML file.

The browser draws the curves (curves.py's dict) with uPlot, shipped in ``static/`` (MIT, see
``static/uPlot.LICENSE``) and inlined into the page: no CDN, so the page works offline and the
report is one self-contained file. Without JavaScript the block shows a line saying so and the
page keeps its server-rendered tables.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from .status_http import json_safe

#: the files inlined into every page (read once per process)
ASSETS = ("uPlot.iife.min.js", "uPlot.min.css", "page.js")


@cache
def asset(name: str) -> str:
    if name not in ASSETS:
        raise KeyError(name)
    return (resources.files("echo2.learner_hub") / "static" / name).read_text(encoding="utf-8")


def script_json(data: Any) -> str:
    """JSON safe inside a ``<script>`` element: ``<``, ``>`` and ``&`` escaped as JSON escapes,
    so no ``</script>`` in the data can end the element."""
    text = json.dumps(json_safe(data), allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def charts_block(curves: Any, *, live: bool) -> str:
    """The charts section: uPlot and page.js inlined, the curves embedded as JSON. ``live``: the
    page then refreshes itself from ``/status.json`` (charts) and ``/tables.html`` every 5 s."""
    start = ('echo2Live("/status.json", "/tables.html", 5000);' if live
             else 'echo2Draw(JSON.parse(document.getElementById("curves-data").textContent));')
    return f"""<style>{asset("uPlot.min.css")}
#charts{{display:flex;flex-wrap:wrap;gap:12px}}.chart{{border:1px solid #ddd;padding:4px}}.none{{color:#888}}</style>
<fieldset id="xaxis" style="display:none"><legend>x axis of the learning curves</legend>
<label><input type="radio" name="x" value="step" checked> learner step</label>
<label><input type="radio" name="x" value="wall_s"> wall time</label></fieldset>
<div id="charts"><noscript><p><i>The curves need JavaScript; the tables below do not.</i></p></noscript></div>
<script type="application/json" id="curves-data">{script_json(curves if curves is not None else {})}</script>
<script>{asset("uPlot.iife.min.js")}</script>
<script>{asset("page.js")}</script>
<script>{start}</script>"""
