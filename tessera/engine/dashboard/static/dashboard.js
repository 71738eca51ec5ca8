// Tessera dashboard: renders samples of the scheduler (the JSON of docs/dashboard.md), live from
// /dashboard/events or replayed from the frames a simulation embedded. No dependencies.
(function () {
  "use strict";
  var BOOT = JSON.parse(document.getElementById("tessera-boot").textContent);
  var HISTORY = 160; // steps drawn in the steps chart
  var css = getComputedStyle(document.documentElement);
  function color(name) { return css.getPropertyValue(name).trim(); }
  var GPU_COLORS = { "0": color("--free"), "1": color("--used"), "2": color("--cached"),
    "3": color("--cached-used"), "4": color("--swapping") };
  var CPU_COLORS = { "0": color("--free"), "1": "#7950f2", "2": "#7950f2", "3": "#7950f2",
    "4": color("--swapping") };

  function $(id) { return document.getElementById(id); }
  function text(id, value) { $(id).textContent = value; }
  function fmt(x, digits) {
    if (x === null || x === undefined) return "-";
    return Number(x).toFixed(digits === undefined ? 1 : digits);
  }
  function secs(x) {
    if (x === null || x === undefined) return "";
    return x < 1 ? (1000 * x).toFixed(0) + " ms" : x.toFixed(1) + " s";
  }
  function count(s, ch) { var n = 0; for (var i = 0; i < s.length; i++) if (s[i] === ch) n++; return n; }
  function signature(s) { // a short hash of a block map, for tests and for skipping redraws
    var h = 2166136261;
    for (var i = 0; i < s.length; i++) { h ^= s.charCodeAt(i); h = Math.imul(h, 16777619); }
    return (h >>> 0).toString(16);
  }

  // ---- components --------------------------------------------------------------------------
  function renderQueues(q) {
    text("q-waiting", q.waiting); text("q-running", q.running); text("q-swapped", q.swapped);
    text("q-oldest-waiting", q.oldest_waiting_s === null ? "" : "oldest " + secs(q.oldest_waiting_s));
    text("q-oldest-swapped", q.oldest_swapped_s === null ? "" : "oldest " + secs(q.oldest_swapped_s));
  }

  function drawBlocks(canvas, blocks, colors) {
    var sig = signature(blocks);
    if (canvas.dataset.signature === sig && canvas.dataset.width === String(canvas.clientWidth)) return;
    canvas.dataset.signature = sig;
    canvas.dataset.width = String(canvas.clientWidth);
    canvas.dataset.used = String(blocks.length - count(blocks, "0") - count(blocks, "2"));
    var n = Math.max(blocks.length, 1);
    var w = canvas.width, h = canvas.height;
    var cell = Math.max(1, Math.floor(Math.sqrt((w * h) / n)));
    var cols = Math.max(1, Math.floor(w / cell));
    while (Math.ceil(n / cols) * cell > h && cell > 1) { cell--; cols = Math.floor(w / cell); }
    var ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, w, h);
    var gap = cell >= 5 ? 1 : 0;
    for (var i = 0; i < blocks.length; i++) {
      ctx.fillStyle = colors[blocks[i]] || "#000";
      ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - gap, cell - gap);
    }
  }

  function renderBlocks(kv) {
    text("kv-free", kv.num_free); text("kv-used", kv.num_used);
    text("kv-cached", kv.num_cached); text("kv-swapping", kv.num_swapping);
    text("kv-summary", kv.num_blocks + " blocks, " + fmt(100 * kv.num_used / Math.max(kv.num_blocks, 1)) + "% used");
    text("kv-cpu-used", kv.cpu.num_used + " / " + kv.cpu.num_blocks);
    drawBlocks($("kv-map"), kv.blocks, GPU_COLORS);
    drawBlocks($("kv-cpu-map"), kv.cpu.blocks, CPU_COLORS);
  }

  function renderSteps(steps, budget) {
    var canvas = $("steps"), ctx = canvas.getContext("2d");
    var w = canvas.width, h = canvas.height;
    ctx.clearRect(0, 0, w, h);
    if (!steps.length) { text("step-last", "no step yet"); return; }
    // bars scale to the largest step in view (a decode-only batch is a sliver of the budget)
    var bw = w / HISTORY, maxMs = 1, maxTokens = 1;
    steps.forEach(function (s) {
      maxMs = Math.max(maxMs, s.step_ms);
      maxTokens = Math.max(maxTokens, s.num_tokens + Math.min(s.spec_accepted, s.spec_drafted));
    });
    var top = Math.min(maxTokens, Math.max(budget, 1)), scale = (h - 16) / top;
    steps.forEach(function (s, i) {
      var x = (HISTORY - steps.length + i) * bw, y = h;
      var spec = Math.min(s.spec_accepted, s.spec_drafted);
      var parts = [[s.prefill_tokens, color("--prefill")], [s.decode_tokens, color("--decode")],
        [spec, color("--spec")]];
      parts.forEach(function (p) {
        var bh = p[0] * scale; ctx.fillStyle = p[1]; ctx.fillRect(x, y - bh, Math.max(bw - 1, 1), bh); y -= bh;
      });
    });
    ctx.strokeStyle = color("--time"); ctx.lineWidth = 1.5; ctx.beginPath();
    steps.forEach(function (s, i) {
      var x = (HISTORY - steps.length + i + 0.5) * bw, y = h - 2 - (s.step_ms / maxMs) * (h - 14);
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
    ctx.fillStyle = color("--time"); ctx.font = "11px sans-serif";
    ctx.fillText("max " + fmt(maxMs) + " ms", 4, 11);
    ctx.textAlign = "right";
    ctx.fillText("bar top " + top + " tokens (budget " + budget + ")", w - 4, 11);
    ctx.textAlign = "left";
    var s = steps[steps.length - 1];
    text("step-last", "step " + s.step + ": prefill " + s.prefill_tokens + " tok, decode " +
      s.decode_tokens + " tok, spec " + s.spec_accepted + "/" + s.spec_drafted +
      " accepted/drafted, budget " + s.num_tokens + "/" + budget + " (" +
      fmt(100 * s.num_tokens / Math.max(budget, 1)) + "%), " + s.num_seqs + " seqs, " +
      fmt(s.step_ms) + " ms" + (s.preempted ? ", " + s.preempted + " preempted" : ""));
  }

  function renderRates(r) {
    if (!r) return;
    text("r-window", "last " + fmt(Math.min(r.span_s, r.window_s), 0) + " s");
    text("r-tok-s", fmt(r.output_tok_s)); text("r-prompt-s", fmt(r.prompt_tok_s));
    text("r-ttft", fmt(r.ttft_p50_ms, 0) + " / " + fmt(r.ttft_p99_ms, 0) + " ms");
    text("r-tpot", fmt(r.tpot_p50_ms) + " / " + fmt(r.tpot_p99_ms) + " ms");
    text("r-preempt", r.preemptions + " (" + r.preemptions_swap + " / " + r.preemptions_recompute + ")");
    text("r-prefix", r.prefix_hit_rate === null ? "-" : fmt(100 * r.prefix_hit_rate) + "%");
  }

  function renderRequests(req) {
    var body = $("req-rows"), rows = req.rows;
    while (body.rows.length > rows.length) body.deleteRow(-1);
    while (body.rows.length < rows.length) {
      var tr = body.insertRow(-1);
      for (var c = 0; c < 7; c++) tr.insertCell(-1);
      tr.cells[0].className = "id";
      tr.cells[6].innerHTML = '<div class="bar"><div></div></div>';
    }
    rows.forEach(function (r, i) { // textContent only: ids are shown as text, never as markup
      var cells = body.rows[i].cells;
      cells[0].textContent = r.id; cells[1].textContent = r.adapter || "";
      cells[2].textContent = r.state; cells[2].className = "state-" + r.state;
      cells[3].textContent = r.prompt_tokens; cells[4].textContent = r.output_tokens;
      cells[5].textContent = r.tokens_done + " / " + r.tokens_total;
      cells[6].firstChild.firstChild.style.width = fmt(100 * r.tokens_done / Math.max(r.tokens_total, 1)) + "%";
    });
    text("req-more", req.num_more ? "(+" + req.num_more + " more)" : "");
  }

  function render(sample, steps) {
    var c = sample.config;
    text("model", c.model + " \u00b7 block " + c.block_size + " \u00b7 max " + c.max_num_seqs +
      " seqs \u00b7 " + c.scheduling_policy);
    renderQueues(sample.queues);
    renderBlocks(sample.kv);
    renderSteps(steps, c.max_num_batched_tokens);
    renderRates(sample.rates);
    renderRequests(sample.requests);
    document.body.dataset.seq = String(sample.seq);
  }

  // ---- live: server-sent events ---------------------------------------------------------------
  function live() {
    var history = [], url = BOOT.events, key = new URLSearchParams(location.search).get("api_key");
    if (key) url += "?api_key=" + encodeURIComponent(key);
    var status = $("status"), source = new EventSource(url);
    source.onopen = function () { status.textContent = "live"; status.className = "pill ok"; };
    source.onerror = function () { status.textContent = "reconnecting"; status.className = "pill bad"; };
    source.onmessage = function (event) {
      var sample = JSON.parse(event.data);
      var last = history.length ? history[history.length - 1].step : 0;
      sample.steps.forEach(function (s) { if (s.step > last) history.push(s); });
      if (history.length > HISTORY) history.splice(0, history.length - HISTORY);
      text("clock", new Date().toLocaleTimeString());
      render(sample, history);
    };
  }

  // ---- replay: frames of a simulation -----------------------------------------------------------
  function replay() {
    var frames = BOOT.frames, slider = $("slider"), play = $("play"), timer = null;
    $("replay").hidden = false;
    text("title", BOOT.title || "simulation");
    text("status", "replay"); $("status").className = "pill";
    slider.max = String(Math.max(frames.length - 1, 0));
    function stepsUpTo(i) {
      var out = [];
      for (var j = i; j >= 0 && out.length < HISTORY; j--) out = frames[j].steps.concat(out);
      return out.slice(-HISTORY);
    }
    function show(i) {
      i = Math.max(0, Math.min(frames.length - 1, i));
      slider.value = String(i);
      var f = frames[i], t0 = frames[0].time, t1 = frames[frames.length - 1].time;
      text("frame-label", "frame " + (i + 1) + "/" + frames.length + " \u00b7 t = " +
        fmt(f.time - t0, 2) + " s of " + fmt(t1 - t0, 2) + " s (virtual)");
      text("clock", "");
      render(f, stepsUpTo(i));
      document.body.dataset.frame = String(i);
    }
    function stop() { if (timer) clearInterval(timer); timer = null; play.textContent = "Play"; }
    play.onclick = function () {
      if (timer) { stop(); return; }
      if (Number(slider.value) >= frames.length - 1) show(0);
      play.textContent = "Pause";
      timer = setInterval(function () {
        var i = Number(slider.value) + 1;
        if (i >= frames.length) { stop(); return; }
        show(i);
      }, Math.max(10, BOOT.interval_ms / Number($("speed").value)));
    };
    slider.oninput = function () { stop(); show(Number(slider.value)); };
    window.tesseraDashboard = { show: show, count: frames.length };
    if (frames.length) show(0);
  }

  if (BOOT.mode === "replay") replay(); else live();
})();
