// The jaxkv live page: one WebSocket to the server (docs/server.md), frames drawn into a canvas at the chosen
// playback rate, each chunk acknowledged once its last frame is on screen (the server generates at most
// ahead_chunks past the last acknowledged chunk, so the page's playback paces the stream).
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const params = new URLSearchParams(location.search);
  const token = params.get("token");
  const canvas = $("screen");
  const ctx = canvas.getContext("2d");

  // Everything the page knows, exposed for the end-to-end test and for the curious (window.jaxkvLive).
  const state = {
    ws: null,
    hello: null,
    session: null,
    paused: false,
    queue: [], // frames received, in order: {chunk, prompt, last, bitmap}
    pending: null, // the chunk header whose frames are arriving
    stopping: false, // stop was sent: frames still on their way belong to that stream and are dropped unshown
    framesShown: 0,
    chunksShown: 0,
    lastChunkShown: -1,
    promptShown: null,
    shownAt: [],
    switches: [],
    saved: [],
    errors: [],
    log: [],
  };
  window.jaxkvLive = state;

  function note(text, isError) {
    const m = $("message");
    m.textContent = text;
    m.className = isError ? "error" : "";
    const li = document.createElement("li");
    li.textContent = text;
    $("log").prepend(li);
    state.log.push(text);
    if (isError) state.errors.push(text);
  }

  function send(message) {
    if (state.ws && state.ws.readyState === WebSocket.OPEN) state.ws.send(JSON.stringify(message));
  }

  function setRunning(running) {
    for (const id of ["switch", "pause", "save", "fork", "stop"]) $(id).disabled = !running;
    $("start").disabled = running;
    $("resume").disabled = running;
  }

  function fillSaved(names) {
    const select = $("saved");
    select.innerHTML = "";
    for (const name of names) {
      const option = document.createElement("option");
      option.value = option.textContent = name;
      select.append(option);
    }
  }

  function connect() {
    const url = new URL("/ws", location.href);
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    if (token) url.searchParams.set("token", token);
    const ws = new WebSocket(url);
    ws.binaryType = "blob";
    state.ws = ws;
    ws.onopen = () => {
      $("connection").textContent = "connected";
      $("connection").className = "badge ok";
    };
    ws.onclose = (event) => {
      $("connection").textContent = `disconnected (${event.code}${event.reason ? ": " + event.reason : ""})`;
      $("connection").className = "badge bad";
      setRunning(false);
      $("start").disabled = $("resume").disabled = true;
    };
    ws.onmessage = (event) => {
      if (typeof event.data === "string") handle(JSON.parse(event.data));
      else frame(event.data);
    };
  }

  function frame(blob) {
    const header = state.pending;
    if (!header) return;
    header.received += 1;
    const item = { chunk: header.chunk, prompt: header.prompt, last: header.received === header.frames, bitmap: null };
    state.queue.push(item);
    createImageBitmap(blob).then((bitmap) => {
      item.bitmap = bitmap;
    });
    if (item.last) state.pending = null;
  }

  function handle(m) {
    switch (m.type) {
      case "hello": {
        state.hello = m;
        $("model").textContent = `${m.model} · ${m.frame_shape[1]}x${m.frame_shape[0]} · ${m.fps} fps`;
        $("prompt").value = m.default_prompt;
        $("prompt").maxLength = m.limits.max_prompt_chars;
        $("fps").value = m.fps;
        if (m.vocabulary) $("vocabulary").textContent = "words: " + m.vocabulary.join(" ");
        state.saved = m.saved.slice();
        fillSaved(state.saved);
        setRunning(false);
        if (params.get("resume")) send({ type: "start", resume: params.get("resume") });
        break;
      }
      case "started": {
        state.session = m;
        state.queue = [];
        state.pending = null;
        state.stopping = false;
        state.switches = m.switches.slice();
        state.paused = false;
        $("pause").textContent = "Pause";
        canvas.width = m.frame_shape[1];
        canvas.height = m.frame_shape[0];
        $("prompt").value = m.prompt;
        const progress = $("progress");
        progress.hidden = m.remaining === null;
        if (m.remaining !== null) {
          progress.max = m.remaining;
          progress.value = 0;
        }
        setRunning(true);
        const given = m.given ? ` after ${m.given.chunks} chunk(s) from the ${m.given.kind}` : "";
        note(`stream ${m.session} started at chunk ${m.chunk}${given}` + (m.resumed_from ? ` (resumed ${m.resumed_from})` : ""));
        break;
      }
      case "chunk": {
        if (state.stopping) break; // its frames find no header and are dropped
        state.pending = Object.assign({ received: 0 }, m);
        if (m.step_ms > 0) $("fps-generated").textContent = ((1000 * m.frames) / m.step_ms).toFixed(1);
        break;
      }
      case "switched":
        state.switches.push([m.chunk, m.prompt]);
        note(`prompt changed to "${m.prompt}" from chunk ${m.chunk}`);
        break;
      case "paused":
      case "playing":
        state.paused = m.type === "paused";
        $("pause").textContent = state.paused ? "Play" : "Pause";
        note(`${m.type} at chunk ${m.chunk}`);
        break;
      case "saved":
      case "forked": {
        state.saved.unshift(m.name);
        fillSaved(state.saved);
        if (m.type === "saved") note(`saved at chunk ${m.chunk} as ${m.name}`);
        else {
          note(`forked at chunk ${m.chunk} as ${m.name}`);
          const li = document.createElement("li");
          const a = document.createElement("a");
          a.href = m.url + (token ? `&token=${encodeURIComponent(token)}` : "");
          a.target = "_blank";
          a.textContent = `open the fork ${m.name} in a new tab`;
          li.append(a);
          $("log").prepend(li);
        }
        break;
      }
      case "stopped":
        state.stopping = false;
        state.queue = []; // frames of the stopped stream are never shown (nor acknowledged)
        state.pending = null;
      // falls through
      case "ended":
        setRunning(false);
        note(`stream ${m.type} at chunk ${m.chunk}`);
        break;
      case "status":
        break;
      case "error":
        note(`error (${m.code}): ${m.message}`, true);
        if (m.request === "start" && m.code !== "already_started") setRunning(false); // a refused start: try again
        break;
      default:
        note(`unknown message ${m.type}`, true);
    }
  }

  // The player: one frame per tick at the chosen rate, once its picture is decoded.
  function tick() {
    const fps = Math.min(120, Math.max(1, Number($("fps").value) || 16));
    setTimeout(tick, 1000 / fps);
    if (state.paused) return;
    const item = state.queue[0];
    if (!item || !item.bitmap) return;
    state.queue.shift();
    ctx.drawImage(item.bitmap, 0, 0, canvas.width, canvas.height);
    item.bitmap.close();
    state.framesShown += 1;
    state.promptShown = item.prompt;
    const now = performance.now();
    state.shownAt.push(now);
    if (state.shownAt.length > 32) state.shownAt.shift();
    $("frames-shown").textContent = state.framesShown;
    $("chunk").textContent = item.chunk;
    $("prompt-now").textContent = item.prompt;
    if (state.shownAt.length > 1) {
      const span = (now - state.shownAt[0]) / 1000;
      $("fps-shown").textContent = ((state.shownAt.length - 1) / span).toFixed(1);
    }
    if (item.last) {
      state.lastChunkShown = item.chunk;
      state.chunksShown += 1;
      const progress = $("progress");
      if (!progress.hidden) progress.value = Math.min(progress.max, progress.value + 1);
      send({ type: "ack", chunk: item.chunk });
    }
  }

  // A picture or video to continue goes up first (POST /api/uploads); start then names the upload.
  async function upload(file) {
    const query = token ? `?token=${encodeURIComponent(token)}` : "";
    const response = await fetch(`/api/uploads${query}`, { method: "POST", body: file });
    const reply = await response.json();
    if (!response.ok) throw new Error(reply.error || `upload failed (${response.status})`);
    return reply.upload;
  }

  $("start").onclick = async () => {
    const message = { type: "start", prompt: $("prompt").value, seed: Number($("seed").value) || 0 };
    const file = $("given").files[0];
    if (file) {
      $("start").disabled = true;
      try {
        message[file.type.startsWith("video/") ? "video" : "image"] = await upload(file);
        note(`uploaded ${file.name} (${file.size} bytes)`);
      } catch (error) {
        note(`${file.name}: ${error.message}`, true);
        $("start").disabled = false;
        return;
      }
    }
    send(message);
  };
  $("switch").onclick = () => send({ type: "prompt", prompt: $("prompt").value });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key !== "Enter") return;
    if (!$("switch").disabled) $("switch").click();
    else if (!$("start").disabled) $("start").click();
  });
  $("pause").onclick = () => send({ type: state.paused ? "play" : "pause" });
  $("save").onclick = () => send({ type: "save" });
  $("fork").onclick = () => send({ type: "fork" });
  // Frames not yet shown are dropped at once and never acknowledged: an ack sent after the stop would reach a
  // server with no stream (a no_session error), or the next stream.
  $("stop").onclick = () => {
    state.stopping = true;
    state.queue = [];
    state.pending = null;
    send({ type: "stop" });
  };
  $("resume").onclick = () => {
    if ($("saved").value) send({ type: "start", resume: $("saved").value });
  };

  setRunning(false);
  connect();
  tick();
})();
