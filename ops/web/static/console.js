// fleetlease console: live updates over server-sent events (GET /events).
// No polling: a page part is re-fetched only when an event says it changed
// (and once when the stream (re)connects, to catch anything missed meanwhile).
(() => {
  "use strict";
  const body = document.body;
  const page = body.dataset.page;

  function setLive(on) {
    body.dataset.live = on ? "on" : "off";
    const badge = document.getElementById("live");
    if (badge) badge.textContent = on ? "live" : "offline";
  }

  async function fetchPart(url) {
    const response = await fetch(url, {
      credentials: "same-origin",
      cache: "no-store",
      headers: { "X-Fleetlease-Part": "1" },
    });
    if (response.status === 401) {
      window.location.reload(); // shows the sign-in page
      return null;
    }
    if (!response.ok) return null;
    return response.text();
  }

  function debounce(fn, ms) {
    let timer = null;
    return () => {
      if (timer !== null) clearTimeout(timer);
      timer = setTimeout(() => { timer = null; fn(); }, ms);
    };
  }

  function listen(url, onTask, onOpen) {
    const source = new EventSource(url);
    // "ready" comes once the server is subscribed (after every (re)connect).
    source.addEventListener("ready", () => { setLive(true); onOpen(); });
    source.addEventListener("error", () => setLive(false));
    source.addEventListener("end", () => { source.close(); setLive(false); });
    source.addEventListener("task", (message) => {
      let event;
      try { event = JSON.parse(message.data); } catch (_) { return; }
      if (event && typeof event.task_id === "string") onTask(event);
    });
    window.addEventListener("pagehide", () => source.close());
  }

  function refresher(container) {
    return debounce(async () => {
      const html = await fetchPart(container.dataset.part);
      if (html !== null) container.innerHTML = html;
    }, 250);
  }

  function whenText(iso) {
    if (typeof iso !== "string" || iso.length < 19) return null;
    return iso.slice(0, 10) + " " + iso.slice(11, 19);
  }

  if (page === "tasks") {
    const table = document.getElementById("tasks");
    const rows = document.getElementById("task-rows");
    const empty = document.getElementById("no-tasks");
    const states = (table.dataset.states || "").split(",").filter(Boolean);
    const host = table.dataset.host || "";
    const pending = new Set();

    const resync = async () => {
      const html = await fetchPart(table.dataset.part);
      if (html !== null) rows.innerHTML = html;
      empty.hidden = rows.children.length > 0;
    };

    const findRow = (id) => {
      for (const row of rows.children) if (row.dataset.taskId === id) return row;
      return null;
    };

    const glow = (row) => {
      row.classList.remove("flash-row");
      void row.offsetWidth; // restart the animation
      row.classList.add("flash-row");
    };

    const onTask = async (event) => {
      if (states.length && !states.includes(event.state)) {
        const stale = findRow(event.task_id);
        if (stale) stale.remove();
        empty.hidden = rows.children.length > 0;
        return;
      }
      if (host && event.host_id && event.host_id !== host) return;
      const row = findRow(event.task_id);
      if (row) {
        const state = row.querySelector('[data-field="state"]');
        if (state) {
          state.textContent = event.state;
          state.className = "state state-" + event.state;
        }
        const updated = row.querySelector('[data-field="updated"]');
        const at = whenText(event.at);
        if (updated && at) updated.textContent = at;
        glow(row);
        return;
      }
      if (host && !event.host_id) return; // not placed yet: cannot match a host filter
      if (pending.has(event.task_id)) return;
      pending.add(event.task_id);
      try {
        const html = await fetchPart("/tasks/" + encodeURIComponent(event.task_id) + "/row");
        if (html === null || findRow(event.task_id)) return;
        const holder = document.createElement("tbody");
        holder.innerHTML = html.trim();
        const fresh = holder.firstElementChild;
        if (!fresh) return;
        rows.insertBefore(fresh, rows.firstElementChild);
        empty.hidden = true;
        glow(fresh);
      } finally {
        pending.delete(event.task_id);
      }
    };
    listen("/events", onTask, resync);
  } else if (page === "task") {
    const detail = document.getElementById("task-detail");
    const refresh = refresher(detail);
    const id = body.dataset.taskId;
    listen("/events?task=" + encodeURIComponent(id), refresh, refresh);
  } else if (page === "fleet") {
    const fleet = document.getElementById("fleet");
    const refresh = refresher(fleet);
    listen("/events", refresh, refresh);
  }
})();
