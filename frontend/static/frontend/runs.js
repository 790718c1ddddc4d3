/* MinT dashboard: a training run's curves on the adapter page (reward, loss, … by training step), drawn with uPlot
 * (vendored: vendor/uplot/). Each chart is an element [data-run-chart=<metric>] whose data-source names the
 * <script type="application/json"> the runs panel embeds (frontend/selectors/runs.py `RunsPanel.chart_json`).
 * The panel is a live section (live.js loads it and re-reads it when a revision changes, then sends
 * `mint:fragment`), so the curves follow the run as the trainer pushes steps. The numbers are in the table beside
 * the charts; after a draw an element carries data-points (the steps drawn) and data-last (the newest value).
 */
(function () {
  "use strict";

  var COLOURS = ["#0b5cad", "#b35900", "#116329", "#6e40c9"];
  var plots = []; // {el, plot}

  function readData(id) {
    var script = document.getElementById(id);
    if (!script) return null;
    try {
      return JSON.parse(script.textContent);
    } catch (err) {
      return null;
    }
  }

  function widthOf(el) {
    return Math.max(160, Math.floor(el.getBoundingClientRect().width));
  }

  function options(el, name, colour) {
    var axis = { stroke: "#57606a", grid: { stroke: "#eaeef2", width: 1 }, ticks: { stroke: "#d0d7de", width: 1 } };
    return {
      width: widthOf(el),
      height: 140,
      legend: { show: false },
      cursor: { drag: { x: false, y: false } },
      scales: { x: { time: false } },
      axes: [Object.assign({ label: "training step" }, axis), Object.assign({ size: 56 }, axis)],
      series: [{ label: "step" }, { label: name, stroke: colour, width: 2, points: { show: true, size: 5 }, spanGaps: true }],
    };
  }

  function draw(el, index) {
    var data = readData(el.dataset.source);
    if (!data || !window.uPlot) return;
    var name = el.dataset.runChart;
    var values = (data.metrics || {})[name] || [];
    var columns = [data.x, values];
    plots = plots.filter(function (entry) {
      if (entry.el === el || !document.body.contains(entry.el)) {
        entry.plot.destroy();
        return false;
      }
      return true;
    });
    el.innerHTML = "";
    plots.push({ el: el, plot: new uPlot(options(el, name, COLOURS[index % COLOURS.length]), columns, el) });
    var known = values.filter(function (v) {
      return typeof v === "number";
    });
    el.dataset.points = String(known.length);
    el.dataset.last = known.length ? String(known[known.length - 1]) : "";
    el.setAttribute(
      "aria-label",
      name + " of run " + data.run + " over " + known.length + " steps" +
        (known.length ? ", from " + known[0] + " to " + known[known.length - 1] : "") +
        ". The numbers are in the table below."
    );
  }

  function drawAll() {
    Array.prototype.forEach.call(document.querySelectorAll("[data-run-chart]"), draw);
  }

  document.addEventListener("mint:fragment", drawAll);
  document.addEventListener("DOMContentLoaded", drawAll);
})();
