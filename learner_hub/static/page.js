// echo2's charts: the status page and `echo2 hub report` draw the run's curves with uPlot
// (vendored beside this file). Input: the "curves" dict of status.json (learner_hub/curves.py).
// The live page calls echo2Live(url) (fetches status.json every 5 s); the report calls
// echo2Draw(curves) once with the curves embedded in the file.
(function () {
  "use strict";
  var COLORS = ["#2a6", "#d62728", "#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];
  var xAxis = "step";
  var last = null;
  var plots = [];

  var LABELS = {
    "echo2/learner_busy_fraction": "learner busy (measured)",
    "echo2/predicted_busy_fraction": "capacity model",
    "completions/mean_length": "mean length",
    "echo2/staleness_mean": "staleness",
  };

  function short(name) {
    if (LABELS[name]) return LABELS[name];
    var m = /^rewards\/(.*)\/mean$/.exec(name);  // TRL's per-function reward: its function's name
    if (m) name = m[1];
    return name.length > 24 ? name.slice(0, 10) + "\u2026" + name.slice(-6) : name;
  }

  // one chart: block {<x>: [...], series: {name: [...]}}, names to draw (all when null)
  // unit: the y axis spans at least [0, 1] (fractions, accuracies: a flat 0 stays readable)
  function chart(el, title, block, x, names, yLabel, unit) {
    var box = document.createElement("div");
    box.className = "chart";
    el.appendChild(box);
    var xs = block && block[x] ? block[x] : [];
    var all = block && block.series ? block.series : {};
    var picked = (names || Object.keys(all)).filter(function (n) { return all[n] && all[n].some(function (v) { return v !== null; }); });
    if (!xs.length || !picked.length) {
      box.innerHTML = "<h3>" + title + "</h3><p class='none'>no points yet</p>";
      return;
    }
    var series = [{ label: x === "wall_s" ? "wall s" : x }];
    var data = [xs];
    picked.forEach(function (n, i) {
      series.push({ label: short(n), stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true, points: { show: xs.length < 60 } });
      data.push(all[n]);
    });
    var opts = {
      title: title,
      width: Math.max(320, Math.min(640, (el.clientWidth || 1300) / 2 - 24)),
      height: 220,
      scales: unit ? { x: { time: false }, y: { range: function (u, lo, hi) { return [Math.min(0, lo), Math.max(1, hi)]; } } }
        : { x: { time: false } },
      axes: [{ label: x === "wall_s" ? "wall time (s)" : x }, { label: yLabel || "" }],
      series: series,
    };
    plots.push(new uPlot(opts, data, box));
  }

  function prefixed(block, prefix, suffix) {
    var s = block && block.series ? block.series : {};
    return Object.keys(s).filter(function (n) { return n.indexOf(prefix) === 0 && (!suffix || n.slice(-suffix.length) === suffix); });
  }

  function draw(curves) {
    var el = document.getElementById("charts");
    if (!el || typeof uPlot === "undefined" || !curves) return;
    last = curves;
    plots.forEach(function (p) { p.destroy(); });
    plots = [];
    el.innerHTML = "";
    var t = curves.train || {}, ev = curves.eval || {};
    chart(el, "Train reward (total and per reward function)", t, xAxis, ["reward"].concat(prefixed(t, "rewards/", "/mean")), "reward");
    chart(el, "Eval (held-out split)", ev, xAxis, ["accuracy", "mean_reward"], "accuracy / reward", true);
    chart(el, "Completion length (tokens, mean)", t, xAxis, ["completions/mean_length"], "tokens");
    chart(el, "Learner utilisation vs capacity model", t, xAxis, ["echo2/learner_busy_fraction", "echo2/predicted_busy_fraction"], "busy fraction", true);
    chart(el, "Broadcast time per version (s to first/median/last node)", curves.broadcast, "version", null, "seconds");
    chart(el, "Accepted tokens/s per node", curves.nodes, "wall_s", null, "tokens/s");
    chart(el, "Staleness of trained rows (mean)", t, xAxis, ["echo2/staleness_mean"], "versions");
  }

  function controls() {
    var c = document.getElementById("xaxis");
    if (!c) return;
    c.style.display = "";
    c.addEventListener("change", function (e) {
      xAxis = e.target.value;
      draw(last);
    });
  }

  // the tables below the charts: the server renders them; the live page swaps in fresh ones
  function swapTables(htmlText) {
    var doc = new DOMParser().parseFromString(htmlText, "text/html");
    var fresh = doc.getElementById("tables"), cur = document.getElementById("tables");
    if (fresh && cur) cur.innerHTML = fresh.innerHTML;
  }

  window.echo2Draw = function (curves) {
    controls();
    draw(curves);
  };

  window.echo2Live = function (jsonUrl, pageUrl, everyMs) {
    controls();
    function tick() {
      fetch(jsonUrl, { cache: "no-store" }).then(function (r) { return r.json(); }).then(function (s) {
        draw(s.curves);
        return fetch(pageUrl, { cache: "no-store" }).then(function (r) { return r.text(); }).then(swapTables);
      }).catch(function (e) { console.log("echo2 status: " + e); });
    }
    var first = document.getElementById("curves-data");
    if (first) draw(JSON.parse(first.textContent));
    setInterval(tick, everyMs || 5000);
  };
})();
