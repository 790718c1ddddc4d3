/* MinT dashboard: live updates over ws/live/, elapsed-time counters, copy buttons, upload progress.
 *
 * A live event (revision.state, placement.state, alias.flip, node.state) is applied in two steps:
 * 1. at once, badges whose data attributes match the event get its state (a placement shown for the
 *    first time gets a provisional row), so a short-lived state is still seen; a revision's or a
 *    placement's element keeps the `updated_us` of what it shows, and an older event (sent by another
 *    process, or overtaken by a page or fragment rendered since) leaves it alone;
 * 2. every section marked data-fragment whose data-live-on names the event type (and whose
 *    data-adapter, if any, names the event's adapter) is re-fetched from the server
 *    (`?fragment=<name>`) and replaced, so the whole row is right, not just its badge.
 * Re-fetches of one section never overlap, and an answer that an event overtook is fetched again.
 * Sections that no event covers (an activation made through the API sends none) also carry data-refresh;
 * a section marked data-load is fetched once as the page opens (what the page itself does not read). Each
 * replaced section gets a `mint:fragment` DOM event (usage.js redraws its charts from the new data).
 * A usage.budget event (a monthly token budget at 80 % or 100 %) shows a banner in #flash.
 * The socket reconnects with capped, jittered exponential backoff; #live shows whether the page is live.
 *
 * The result of an action shows next to the control that was used, in its slot `#result-<anchor>` (a live
 * region, kept across re-fetches), and focus moves there. A page shown again by Back or Forward from the
 * back/forward cache is reloaded: what it showed may be over.
 */
(function () {
  "use strict";

  var body = document.body;
  var indicator = null;
  var socket = null;
  var attempt = 0;
  var pinger = null;

  function setLive(state, text) {
    if (!indicator) return;
    indicator.dataset.state = state;
    indicator.textContent = text;
  }

  // ------------------------------------------------------------ fragments

  var sections = {}; // name -> {busy, dirty, generation}

  function fragmentUrl(name) {
    var params = new URLSearchParams(window.location.search);
    params.set("fragment", name);
    return window.location.pathname + "?" + params.toString();
  }

  function refresh(section) {
    var name = section.dataset.fragment;
    var s = sections[name] || (sections[name] = { busy: false, dirty: false, generation: 0 });
    s.generation += 1;
    if (s.busy) {
      s.dirty = true;
      return;
    }
    s.busy = true;
    s.dirty = false;
    var started = s.generation;
    fetch(fragmentUrl(name), { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
      .then(function (response) {
        if (response.redirected || !response.ok) throw new Error("fragment " + name + ": " + response.status);
        return response.text();
      })
      .then(function (html) {
        // An event that arrived while this was in flight may be newer than what it read: fetch again instead.
        if (s.generation === started) replace(section, html);
        else s.dirty = true;
      })
      .catch(function (err) {
        if (window.console) console.warn(err);
      })
      .then(function () {
        s.busy = false;
        if (s.dirty) refresh(section);
      });
  }

  function replace(section, html) {
    // Keep open <details> (a confirmation being filled in), results of actions, and focus where they were.
    var open = Array.prototype.map.call(section.querySelectorAll("details[open]"), keyOf);
    var results = {};
    Array.prototype.forEach.call(section.querySelectorAll("[data-result][data-client]"), function (slot) {
      results[slot.id] = slot.innerHTML;
    });
    var focused = document.activeElement && section.contains(document.activeElement) ? focusKey(document.activeElement) : null;
    var typed = {};
    Array.prototype.forEach.call(section.querySelectorAll("input[id]:not([type=hidden])"), function (input) {
      if (input.value) typed[input.id] = input.value;
    });
    section.innerHTML = html;
    label(section); // before the open confirmations are found again by their key
    Object.keys(typed).forEach(function (id) {
      var input = document.getElementById(id);
      if (input && section.contains(input)) input.value = typed[id];
    });
    open.forEach(function (key) {
      var d = key && section.querySelector('[data-key-of="' + key + '"]');
      if (d) d.open = true;
    });
    Object.keys(results).forEach(function (id) {
      var slot = document.getElementById(id);
      if (slot && section.contains(slot) && !slot.textContent) {
        slot.innerHTML = results[id];
        slot.setAttribute("data-client", "");
      }
    });
    if (focused) {
      var f = findFocus(section, focused);
      if (f) f.focus({ preventScroll: true });
    }
    tick();
    overflowing(section);
    section.dispatchEvent(new CustomEvent("mint:fragment", { bubbles: true }));
  }

  // Where focus was, in words that survive a re-render: its id, else what it is and what it leads to.
  function focusKey(el) {
    if (el.id) return { id: el.id };
    if (el.matches("a[href]")) return { selector: 'a[href="' + el.getAttribute("href") + '"]', text: el.textContent };
    var form = el.closest("form");
    var details = el.closest("details");
    if (el.matches("summary") && details) return { details: keyOf(details) };
    if (form) return { form: form.getAttribute("action"), name: el.getAttribute("name"), text: el.textContent };
    return null;
  }

  function findFocus(section, key) {
    if (key.id) return document.getElementById(key.id);
    var candidates = [];
    if (key.selector) candidates = section.querySelectorAll(key.selector);
    else if (key.details) {
      var d = section.querySelector('[data-key-of="' + key.details + '"]');
      return d && d.querySelector("summary");
    } else if (key.form) {
      candidates = Array.prototype.filter.call(section.querySelectorAll("form"), function (f) {
        return f.getAttribute("action") === key.form;
      }).reduce(function (all, f) {
        return all.concat(Array.prototype.slice.call(f.querySelectorAll("button, input, select")));
      }, []);
      candidates = candidates.filter(function (c) {
        return c.getAttribute("name") === key.name;
      });
    }
    for (var i = 0; i < candidates.length; i++) if (candidates[i].textContent === key.text) return candidates[i];
    return candidates[0] || null;
  }

  function keyOf(details) {
    return details.getAttribute("data-key-of");
  }

  function label(root) {
    // A stable key for each <details> so that an open confirmation survives a refresh.
    Array.prototype.forEach.call(root.querySelectorAll("details"), function (d) {
      var form = d.querySelector("form");
      if (!form) {
        if (d.id) d.setAttribute("data-key-of", "#" + d.id); // a table to read, opened by the person
        return;
      }
      // Several forms share an action (activate, roll back): the alias and revision they name tell them apart.
      var extra = ["alias", "revision"].map(function (name) {
        var input = form.querySelector('input[type=hidden][name="' + name + '"]');
        return input ? input.value : "";
      });
      d.setAttribute("data-key-of", [form.getAttribute("action")].concat(extra).join("|"));
    });
  }

  function matches(section, event) {
    var on = (section.dataset.liveOn || "").split(/\s+/);
    var family = event.type.split(".")[0] + ".*";
    if (on.indexOf(event.type) < 0 && on.indexOf(family) < 0) return false;
    var adapter = section.dataset.adapter;
    return !adapter || !event.adapter || adapter === event.adapter;
  }

  // ------------------------------------------------------------ in-place patches

  function setBadge(el, state) {
    if (!el) return;
    el.textContent = state.replace(/_/g, " ");
    el.className = el.className.replace(/\bstate-\S+/g, "").trim() + " state-" + state;
  }

  // Whether `event` is at least as new as what `el` shows; if so, `el` now shows it.
  function newer(el, event) {
    if (Number(el.dataset.updatedUs) > event.updated_us) return false;
    el.dataset.updatedUs = String(event.updated_us);
    return true;
  }

  function patch(event) {
    if (event.type === "placement.state") {
      var rows = document.querySelectorAll('[data-placement-id="' + event.id + '"]');
      if (!rows.length) addPlacementRow(event);
      Array.prototype.forEach.call(rows, function (row) {
        if (newer(row, event)) setBadge(row.querySelector("[data-placement-state]"), event.state);
      });
    } else if (event.type === "revision.state") {
      var rev = document.querySelector('[data-revision-id="' + event.id + '"]');
      if (rev && newer(rev, event)) setBadge(rev.querySelector("[data-revision-state]"), event.state);
    } else if (event.type === "node.state") {
      var nodes = document.querySelectorAll('[data-node="' + event.node + '"] [data-node-state]');
      Array.prototype.forEach.call(nodes, function (b) {
        setBadge(b, event.state);
      });
    }
  }

  function addPlacementRow(event) {
    var template = document.getElementById("placement-row-template");
    if (!template || body.dataset.adapter !== event.adapter) return;
    var article = document.querySelector('[data-revision="' + event.revision + '"]');
    var table = article && article.querySelector("[data-placements]");
    if (!table) return;
    var box = article.querySelector("[data-placements-box]");
    if (box) box.hidden = false;
    var row = template.content.firstElementChild.cloneNode(true);
    row.setAttribute("data-placement-id", String(event.id));
    row.dataset.updatedUs = String(event.updated_us);
    row.querySelector("[data-node]").textContent = event.node || "";
    setBadge(row.querySelector("[data-placement-state]"), event.state);
    table.querySelector("tbody").appendChild(row);
    table.hidden = false;
  }

  // ------------------------------------------------------------ budget banner

  function number(n) {
    return typeof n === "number" ? n.toLocaleString("en") : String(n);
  }

  // A monthly token budget reached 80 % (warning) or 100 % (exhausted): say so at the top of the page, once per
  // budget (the newer state replaces the older). Another tenant's event reaches staff without its numbers: skipped.
  function budgetBanner(event) {
    var flash = document.getElementById("flash");
    if (!flash || typeof event.budget !== "number") return;
    var who = event.scope === "key" && event.key ? "Key mint_" + event.key + "_…'s" : "The tenant's";
    var text =
      who + " monthly token budget for " + event.month + " is " + (event.state === "exhausted" ? "used up" : event.threshold + " % used") +
      ": " + number(event.used) + " of " + number(event.budget) + " tokens." +
      (event.state === "exhausted" ? " Requests get 429 budget_exhausted until " : " It resets ") +
      String(event.resets_at || "").replace("T", " ").replace(/(:\d\d)(\.\d+)?(\+00:00|Z)$/, "$1 UTC") + ".";
    var id = "budget-" + (event.scope || "tenant") + "-" + (event.key || "");
    var item = document.getElementById(id);
    if (!item) {
      var list = flash.querySelector("ul.messages");
      if (!list) {
        list = document.createElement("ul");
        list.className = "messages";
        flash.appendChild(list);
      }
      item = document.createElement("li");
      item.id = id;
      list.appendChild(item);
    }
    item.className = event.state === "exhausted" ? "msg-error" : "msg-warning";
    item.setAttribute("data-budget-alert", event.state);
    item.textContent = text;
  }

  function onEvent(event) {
    if (!event || !event.type || event.type === "pong") return;
    if (event.type === "usage.budget") budgetBanner(event);
    patch(event);
    Array.prototype.forEach.call(document.querySelectorAll("[data-fragment]"), function (section) {
      if (matches(section, event)) refresh(section);
    });
  }

  // ------------------------------------------------------------ the socket

  function connect() {
    var path = body.dataset.ws;
    if (!path || !window.WebSocket) return;
    var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
    setLive("connecting", attempt ? "reconnecting…" : "connecting…");
    socket = new WebSocket(scheme + window.location.host + path);
    socket.onopen = function () {
      var wasDown = attempt > 0;
      attempt = 0;
      setLive("on", "live");
      // Anything missed while disconnected: bring every live section up to date.
      if (wasDown) Array.prototype.forEach.call(document.querySelectorAll("[data-fragment]"), refresh);
      clearInterval(pinger);
      pinger = setInterval(function () {
        if (socket && socket.readyState === 1) socket.send(JSON.stringify({ type: "ping" }));
      }, 25000);
    };
    socket.onmessage = function (message) {
      try {
        onEvent(JSON.parse(message.data));
      } catch (err) {
        if (window.console) console.warn(err);
      }
    };
    socket.onclose = function (closed) {
      clearInterval(pinger);
      socket = null;
      if (closed.code === 4401 || closed.code === 4403) {
        setLive("off", closed.code === 4401 ? "signed out" : "not allowed");
        return;
      }
      attempt += 1;
      var delay = Math.min(30000, 500 * Math.pow(2, attempt - 1)) * (0.75 + Math.random() / 2);
      setLive("off", "offline, retrying in " + Math.round(delay / 1000) + " s");
      setTimeout(connect, delay);
    };
  }

  // ------------------------------------------------------------ elapsed times, copy, upload

  function elapsed(seconds) {
    if (seconds < 60) return seconds + " s";
    if (seconds < 3600) return Math.floor(seconds / 60) + " min " + (seconds % 60) + " s";
    return Math.floor(seconds / 3600) + " h " + Math.floor((seconds % 3600) / 60) + " min";
  }

  function tick() {
    var now = Date.now();
    Array.prototype.forEach.call(document.querySelectorAll("[data-since]"), function (el) {
      var since = Date.parse(el.dataset.since);
      if (!isNaN(since)) el.textContent = elapsed(Math.max(0, Math.round((now - since) / 1000)));
    });
  }

  function copyButtons() {
    document.addEventListener("click", function (e) {
      var button = e.target.closest ? e.target.closest("[data-copy]") : null;
      if (!button) return;
      var input = document.querySelector(button.dataset.copy);
      var note = button.parentNode.querySelector(".copied");
      input.select();
      var done = function () {
        if (note) note.textContent = "copied";
      };
      if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(input.value).then(done, done);
      else {
        document.execCommand("copy");
        done();
      }
    });
  }

  function uploads() {
    Array.prototype.forEach.call(document.querySelectorAll("form[data-upload]"), function (form) {
      form.addEventListener("submit", function (e) {
        if (!window.XMLHttpRequest || !window.FormData) return;
        e.preventDefault();
        var note = form.querySelector(".upload-progress");
        var started = Date.now();
        var xhr = new XMLHttpRequest();
        xhr.open("POST", form.action);
        xhr.setRequestHeader("X-Requested-With", "fetch");
        xhr.upload.onprogress = function (p) {
          var secs = Math.round((Date.now() - started) / 1000);
          if (p.lengthComputable) note.textContent = "uploading " + Math.round((100 * p.loaded) / p.total) + "% · " + elapsed(secs);
        };
        xhr.onload = function () {
          var result;
          try {
            result = JSON.parse(xhr.responseText);
          } catch (err) {
            result = { ok: false, message: xhr.status === 403 ? "Not allowed." : "Upload failed (" + xhr.status + ")." };
          }
          note.textContent = "";
          show(result.anchor, form, result.ok, result.message);
          if (result.ok) form.reset();
          Array.prototype.forEach.call(document.querySelectorAll("[data-fragment]"), refresh);
        };
        xhr.onerror = function () {
          note.textContent = "upload failed; try again";
        };
        note.textContent = "uploading…";
        xhr.send(new FormData(form));
      });
    });
  }

  // The slot for an action's result: the one its answer names, else the nearest one to the form, else #flash.
  function slotFor(anchor, form) {
    var slot = anchor ? document.getElementById("result-" + anchor) : null;
    if (!slot && form) {
      var holder = form.closest("article, li, section, details");
      slot = holder && holder.querySelector("[data-result]");
    }
    return slot || document.getElementById("flash");
  }

  function show(anchor, form, ok, text) {
    var slot = slotFor(anchor, form);
    if (!slot) return;
    var item = document.createElement("p");
    item.className = "msg " + (ok ? "msg-success" : "msg-error");
    item.textContent = text;
    slot.innerHTML = "";
    slot.appendChild(item);
    slot.setAttribute("data-client", "");
    if (!slot.hasAttribute("tabindex")) slot.setAttribute("tabindex", "-1");
    slot.focus({ preventScroll: false });
  }

  function enhancedForms() {
    // Action forms are sent from the page, so the page and its live socket stay; without script they post normally.
    document.addEventListener("submit", function (e) {
      var form = e.target;
      if (!form.matches || !form.matches("form[data-enhance]") || !window.fetch) return;
      e.preventDefault();
      var button = form.querySelector("button[type=submit]");
      if (button) button.disabled = true;
      fetch(form.action, {
        method: "POST",
        body: new FormData(form),
        credentials: "same-origin",
        headers: { "X-Requested-With": "fetch" },
      })
        .then(function (response) {
          var type = response.headers.get("Content-Type") || "";
          if (type.indexOf("application/json") === 0) return response.json();
          return { ok: false, message: response.status === 403 ? "Not allowed." : "Failed (" + response.status + ")." };
        })
        .then(function (result) {
          show(result.anchor, form, result.ok, result.message || (result.ok ? "Done." : "Failed."));
          var details = form.closest("details");
          if (details && result.ok) details.open = false;
          Array.prototype.forEach.call(document.querySelectorAll("[data-fragment]"), refresh);
        })
        .catch(function () {
          show("", form, false, "The server could not be reached; nothing may have changed.");
        })
        .then(function () {
          if (button) button.disabled = false;
        });
    });
  }

  // An activation's confirmation, when opened, asks the server what to know first (no room on the nodes...).
  function roomWarnings() {
    document.addEventListener(
      "toggle",
      function (e) {
        var details = e.target;
        if (!details.open || !details.querySelector) return;
        var box = details.querySelector("[data-room]");
        if (!box || box.dataset.loaded) return;
        box.dataset.loaded = "1";
        fetch(box.dataset.room, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
          .then(function (response) {
            return response.ok ? response.text() : "";
          })
          .then(function (html) {
            if (html.trim()) box.innerHTML = html;
          })
          .catch(function () {});
      },
      true
    );
  }

  // Mark scroll boxes whose table is wider than they are: the stylesheet shows a hint.
  function overflowing(root) {
    Array.prototype.forEach.call((root || document).querySelectorAll(".scroll"), function (box) {
      if (box.scrollWidth > box.clientWidth + 1) box.setAttribute("data-overflowing", "");
      else box.removeAttribute("data-overflowing");
    });
  }

  // After a form posted without script, the server's redirect names the result's slot: focus it.
  function focusResult() {
    var message = document.querySelector("[data-result] [data-server-message]");
    var slot = message ? message.closest("[data-result]") : null;
    if (!slot) {
      var top = document.querySelector("#flash li");
      slot = top ? document.getElementById("flash") : null;
      if (slot) slot.setAttribute("tabindex", "-1");
    }
    if (!slot && window.location.hash.length > 1) {
      // A redirect to what an action made (a new key's token): focus it if it takes focus.
      var target = document.getElementById(decodeURIComponent(window.location.hash.slice(1)));
      if (target && target.hasAttribute("tabindex")) slot = target;
    }
    if (slot) {
      var details = slot.closest("details");
      if (details) details.open = true;
      slot.focus();
    }
  }

  // A page restored from the back/forward cache shows what was true when it was left: read it again.
  window.addEventListener("pageshow", function (e) {
    if (e.persisted) window.location.reload();
  });

  document.addEventListener("DOMContentLoaded", function () {
    enhancedForms();
    roomWarnings();
    focusResult();
    overflowing(document);
    window.addEventListener("resize", function () {
      overflowing(document);
    });
    indicator = document.getElementById("live");
    label(document);
    tick();
    setInterval(tick, 1000);
    copyButtons();
    uploads();
    Array.prototype.forEach.call(document.querySelectorAll("[data-fragment][data-load]"), refresh);
    Array.prototype.forEach.call(document.querySelectorAll("[data-fragment][data-refresh]"), function (section) {
      setInterval(function () {
        if (!document.hidden) refresh(section);
      }, parseInt(section.dataset.refresh, 10));
    });
    if (body.dataset.ws) connect();
    else setLive("off", "offline");
  });
})();
