/* MinT dashboard: the usage charts, drawn with uPlot (vendored: vendor/uplot/, see its README).
 *
 * Each chart is an element [data-chart=<measures>] whose data-source names the <script type="application/json">
 * the page embeds (Django's json_script, frontend/selectors/usage.py `UsageView.chart_json`). That script sits in
 * a live section (live.js re-reads it on a timer and on usage.* events); each time one is replaced, live.js sends
 * `mint:fragment` and the charts are given the new data (the chart elements and their headings stay in place).
 * The Nodes page draws its residency charts the same way (MEASURES moves, tiers, misses).
 * The numbers are also in the tables beside the charts (their text alternative); each chart's label says what it
 * shows in words. After a draw the element carries data-drawn: each series' sum as drawn (read by the tests).
 */
(function () {
  "use strict";

  // Measures per chart: [field of the data, label, colour]. A field that is null (not known) is left out.
  var MEASURES = {
    requests: [["requests", "Requests", "#0b5cad"]],
    tokens: [
      ["prompt_tokens", "Prompt tokens", "#0b5cad"],
      ["completion_tokens", "Completion tokens", "#b35900"],
    ],
    latency: [
      ["latency_p50_ms", "p50", "#116329"],
      ["latency_p95_ms", "p95", "#b42318"],
    ],
    errors: [
      ["errors", "Errors (status 400 and up)", "#b42318"],
      ["unavailable", "503", "#7a4a00"],
      ["limited", "429", "#6e40c9"],
    ],
    // The Nodes page: each node's residency tiers per minute (serving/selectors/residency.py node_series).
    moves: [
      ["loads", "Loads", "#0b5cad"],
      ["cold", "Loads on demand", "#b35900"],
      ["evictions", "Evictions", "#b42318"],
    ],
    tiers: [
      ["gpu_share", "Share found in the GPU batch", "#116329"],
      ["cpu_share", "Share found loaded (CPU) only", "#0b5cad"],
    ],
    misses: [["miss", "Requests for a revision loaded nowhere", "#b42318"]],
  };
  var HEIGHT = { normal: 200, small: 140 };
  var plots = []; // {el, plot, key}

  function readData(id) {
    var script = document.getElementById(id);
    if (!script) return null;
    try {
      return JSON.parse(script.textContent);
    } catch (err) {
      return null;
    }
  }

  function measuresOf(el, data) {
    return (MEASURES[el.dataset.chart] || []).filter(function (m) {
      return Array.isArray(data[m[0]]);
    });
  }

  function sum(values) {
    return values.reduce(function (a, v) {
      return a + (typeof v === "number" ? v : 0);
    }, 0);
  }

  function widthOf(el) {
    return Math.max(160, Math.floor(el.getBoundingClientRect().width));
  }

  function heightOf(el) {
    return el.classList.contains("small-chart") ? HEIGHT.small : HEIGHT.normal;
  }

  function entryOf(el) {
    for (var i = 0; i < plots.length; i++) if (plots[i].el === el) return plots[i];
    return null;
  }

  function pad(n) {
    return (n < 10 ? "0" : "") + n;
  }

  // Time labels as the rest of the dashboard writes them, in UTC: 14:05, with the day (11-30) under the first
  // label and under midnight; only the day for daily buckets.
  function timeLabels(bucketSeconds) {
    return function (u, splits) {
      return splits.map(function (ts, i) {
        var d = new Date(ts * 1000);
        var day = pad(d.getUTCMonth() + 1) + "-" + pad(d.getUTCDate());
        if (bucketSeconds >= 86400) return day;
        var hm = pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes());
        return i === 0 || hm === "00:00" ? hm + "\n" + day : hm;
      });
    };
  }

  function options(el, data, measures) {
    var axis = { stroke: "#57606a", grid: { stroke: "#eaeef2", width: 1 }, ticks: { stroke: "#d0d7de", width: 1 } };
    var range = function (u, min, max) {
      return [0, max > 0 ? max * 1.1 : 1];
    };
    return {
      width: widthOf(el),
      height: heightOf(el),
      legend: { show: false }, // the legend is drawn below as text (it stays readable and out of the canvas)
      cursor: { drag: { x: false, y: false } },
      tzDate: function (ts) {
        return uPlot.tzDate(new Date(ts * 1000), "Etc/UTC"); // the dashboard's times are UTC
      },
      scales: { x: { time: true }, y: { range: range } },
      axes: [Object.assign({ values: timeLabels(data.bucket_s) }, axis), Object.assign({ size: 56 }, axis)],
      series: [{ label: "UTC" }].concat(
        measures.map(function (m) {
          return { label: m[1], stroke: m[2], width: 2, points: { show: true, size: 5 }, spanGaps: false };
        })
      ),
    };
  }

  function legend(el, measures) {
    var figure = el.closest("figure") || el.parentNode;
    var list = figure.querySelector("ul.legend");
    if (!list) {
      list = document.createElement("ul");
      list.className = "legend";
      figure.appendChild(list);
    }
    list.innerHTML = "";
    measures.forEach(function (m) {
      var item = document.createElement("li");
      var swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = m[2];
      swatch.setAttribute("aria-hidden", "true");
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(m[1]));
      list.appendChild(item);
    });
  }

  function describe(el, data, measures, sums) {
    var caption = (el.closest("figure") || document).querySelector("figcaption");
    var title = caption ? caption.textContent.trim() : el.dataset.chart;
    var parts = measures.map(function (m) {
      return el.dataset.chart === "latency" ? null : m[1] + " " + sums[m[0]].toLocaleString("en");
    });
    var totals = parts.filter(Boolean).join(", ");
    if (el.dataset.chart === "latency" && data.totals) {
      var t = data.totals;
      totals = "p50 " + (t.latency_p50_ms === null ? "none" : t.latency_p50_ms + " ms") +
        ", p95 " + (t.latency_p95_ms === null ? "none" : t.latency_p95_ms + " ms") + " over the range";
    }
    el.setAttribute(
      "aria-label",
      title + " per " + data.per + " over " + data.label + (totals ? ": " + totals : "") + ". The numbers are in the tables below."
    );
  }

  function draw(el) {
    var data = readData(el.dataset.source);
    if (!data || !window.uPlot) return;
    var measures = measuresOf(el, data);
    var columns = [data.x].concat(
      measures.map(function (m) {
        return data[m[0]];
      })
    );
    var key = measures
      .map(function (m) {
        return m[0];
      })
      .join(",");
    var entry = entryOf(el);
    if (entry && entry.key === key) {
      entry.plot.setData(columns);
    } else {
      if (entry) {
        entry.plot.destroy();
        plots.splice(plots.indexOf(entry), 1);
      }
      el.innerHTML = "";
      entry = { el: el, key: key, plot: new uPlot(options(el, data, measures), columns, el) };
      plots.push(entry);
      legend(el, measures);
    }
    var sums = {};
    measures.forEach(function (m, i) {
      sums[m[0]] = sum(entry.plot.data[i + 1]);
    });
    el.dataset.drawn = JSON.stringify(sums);
    el.dataset.points = String(entry.plot.data[0].length);
    describe(el, data, measures, sums);
  }

  function drawAll() {
    Array.prototype.forEach.call(document.querySelectorAll("[data-chart]"), draw);
  }

  function resize() {
    plots.forEach(function (entry) {
      entry.plot.setSize({ width: widthOf(entry.el), height: heightOf(entry.el) });
    });
  }

  document.addEventListener("mint:fragment", drawAll);
  document.addEventListener("DOMContentLoaded", function () {
    drawAll();
    var pending = null;
    window.addEventListener("resize", function () {
      clearTimeout(pending);
      pending = setTimeout(resize, 100);
    });
  });
})();
