// shoal dashboard: one script for every page (body[data-page] says which), no framework.
// Data comes from the dashboard's JSON API and its server-sent event streams; charts are uPlot
// (static/vendor/). Text from the API is always set with textContent, never parsed as HTML.
"use strict";

(() => {
  const page = document.body.dataset.page;
  const COLORS = ["#2563eb", "#f97316", "#16a34a", "#9333ea", "#dc2626", "#0891b2",
    "#ca8a04", "#db2777", "#4b5563", "#65a30d"];
  const shoal = (window.shoal = { charts: {}, state: {} });
  let me = null;

  // -- helpers ----------------------------------------------------------------------------------

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === undefined || value === null) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key === "data") Object.assign(node.dataset, value);
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  const $ = (id) => document.getElementById(id);
  const fmtNum = (v, digits = 4) => (v === null || v === undefined ? "-" : Number(v).toFixed(digits));
  const fmtTime = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "-");
  function fmtBytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  }
  function color(i, alpha) {
    const c = COLORS[i % COLORS.length];
    if (alpha === undefined) return c;
    const a = Math.round(alpha * 255).toString(16).padStart(2, "0");
    return c + a;
  }
  function badge(state) { return el("span", { class: `badge ${state}`, text: state }); }
  function problem(message) {
    const box = $("problem");
    if (!box) return;
    box.hidden = !message;
    box.textContent = message || "";
  }
  function setLive(on) {
    const live = $("live");
    if (!live) return;
    live.textContent = on ? "live" : "reconnecting";
    live.className = `live ${on ? "on" : "off"}`;
  }
  function toLogin() {
    const next = encodeURIComponent(location.pathname);
    location.assign(`/login?next=${next}`);
  }

  async function api(path, options = {}) {
    const init = { credentials: "same-origin", headers: {}, ...options };
    if (init.body !== undefined) {
      init.method = init.method || "POST";
      init.headers["content-type"] = "application/json";
      init.body = JSON.stringify(init.body);
    }
    if (init.method && init.method !== "GET" && me) init.headers["x-csrf-token"] = me.csrf;
    const reply = await fetch(path, init);
    let data = null;
    try { data = await reply.json(); } catch (e) { data = null; }
    if (reply.status === 401 && page !== "login") { toLogin(); throw new Error("log in first"); }
    if (!reply.ok) throw new Error((data && data.message) || `${reply.status} ${reply.statusText}`);
    return data;
  }

  // A server-sent event stream with handlers per event name; "fatal" ends it.
  function live(path, handlers) {
    const source = new EventSource(path);
    source.onopen = () => setLive(true);
    source.onerror = async () => {
      setLive(false);
      if (source.readyState === EventSource.CLOSED) {
        try { await api("/api/me"); } catch (e) { return; }
      }
    };
    for (const [name, handle] of Object.entries(handlers)) {
      source.addEventListener(name, (event) => {
        if (name !== "problem") problem("");
        handle(JSON.parse(event.data));
      });
    }
    source.addEventListener("problem", (event) => {
      problem(`The cluster did not answer: ${JSON.parse(event.data).message} (retrying)`);
    });
    source.addEventListener("fatal", (event) => {
      const data = JSON.parse(event.data);
      source.close();
      setLive(false);
      if (data.error === "UNAUTHENTICATED") { toLogin(); return; }
      problem(data.error === "NOT_FOUND" ? "Not found, or not yours." : data.message);
      if (handlers.fatal) handlers.fatal(data);
    });
    return source;
  }

  // -- charts -----------------------------------------------------------------------------------

  function chartWidth(container) { return Math.max(320, container.clientWidth - 8); }

  // Vertical dashed lines with a label ("4→8") at each rescale.
  function markersPlugin(getMarkers, key) {
    return {
      hooks: {
        draw: [
          (u) => {
            const markers = getMarkers() || [];
            const { ctx } = u;
            const { top, height, left, width } = u.bbox;
            ctx.save();
            ctx.strokeStyle = "#6b7280";
            ctx.fillStyle = "#374151";
            ctx.setLineDash([5, 4]);
            ctx.lineWidth = 1 * devicePixelRatio;
            ctx.font = `${11 * devicePixelRatio}px system-ui, sans-serif`;
            for (const m of markers) {
              const x = Math.round(u.valToPos(m[key], "x", true));
              if (x < left || x > left + width) continue;
              ctx.beginPath();
              ctx.moveTo(x, top);
              ctx.lineTo(x, top + height);
              ctx.stroke();
              ctx.fillText(`${m.from}→${m.to}`, x + 3 * devicePixelRatio, top + 12 * devicePixelRatio);
            }
            ctx.restore();
          },
        ],
      },
    };
  }

  function lineChart(container, title, xLabel, data, markers, markerKey) {
    const box = el("div", { data: { metric: title } }, el("h3", { text: title }));
    container.append(box);
    const opts = {
      width: chartWidth(box),
      height: 220,
      scales: { x: { time: false } },
      axes: [xLabel === "epoch" ? { label: xLabel, incrs: [1, 2, 5, 10, 20, 50, 100] } : { label: xLabel }, {}],
      series: [
        { label: xLabel },
        { label: title, stroke: color(0), width: 1.5, spanGaps: true, points: { show: xLabel === "epoch" } },
      ],
      plugins: [markersPlugin(markers, markerKey)],
      legend: { show: true },
    };
    const chart = new uPlot(opts, data, box);
    return chart;
  }

  // GPUs per job over time: a stacked step chart (each job's band on top of the previous
  // ones), extended to "now" every second while the page is open.
  function allocationChart(container, legend) {
    let chart = null;
    let key = "";
    let latest = null;
    let raw = [];
    let clockOffset = 0;

    function build(alloc) {
      const nowX = Date.now() / 1000 + clockOffset;
      const xs = alloc.t.slice();
      raw = alloc.jobs.map((j) => j.values.slice());
      if (xs.length && nowX > xs[xs.length - 1]) {
        xs.push(nowX);
        raw.forEach((row) => row.push(row[row.length - 1]));
      }
      const acc = xs.map(() => 0);
      const stacked = raw.map((row) => row.map((v, i) => (acc[i] += v)));
      return [xs, ...stacked];
    }

    function create(alloc, data) {
      if (chart) chart.destroy();
      container.textContent = "";
      const series = [{}];
      const bands = [];
      alloc.jobs.forEach((job, i) => {
        series.push({
          label: `${job.job_id} (${job.name})`,
          stroke: color(i),
          width: 2,
          fill: i === 0 ? color(i, 0.35) : undefined,
          paths: uPlot.paths.stepped({ align: 1 }),
          points: { show: false },
          value: (u, v, si, di) => (di === null || raw[si - 1] === undefined ? "-" : raw[si - 1][di]),
        });
        if (i > 0) bands.push({ series: [i + 1, i], fill: color(i, 0.35) });
      });
      const top = Math.max(alloc.capacity || 0, ...data.slice(1).map((r) => Math.max(0, ...r)), 1);
      chart = new uPlot(
        {
          width: chartWidth(container),
          height: 280,
          series,
          bands,
          scales: { y: { range: [0, top + 0.5] } },
          axes: [{}, { label: "GPUs (learners)", incrs: [1, 2, 4, 8, 16, 32, 64, 128] }],
        },
        data,
        container,
      );
      shoal.charts.alloc = chart;
    }

    function renderLegend(alloc) {
      legend.textContent = "";
      alloc.jobs.forEach((job, i) => {
        const now = job.values.length ? job.values[job.values.length - 1] : 0;
        if (!now && job.state !== "running") return;
        legend.append(
          el("li", { data: { job: job.job_id, gpus: String(now) } },
            el("span", { class: "swatch", style: undefined }),
            `${job.job_id} (${job.name}): `, el("b", { text: String(now) }), ` GPU${now === 1 ? "" : "s"}`),
        );
        legend.lastChild.firstChild.style.background = color(i);
      });
    }

    setInterval(() => { if (latest && chart) chart.setData(build(latest)); }, 1000);
    window.addEventListener("resize", () => chart && chart.setSize({ width: chartWidth(container), height: 280 }));

    return {
      update(alloc, serverTime) {
        if (serverTime) clockOffset = serverTime - Date.now() / 1000;
        latest = alloc;
        shoal.state.allocation = alloc;
        const data = build(alloc);
        const newKey = `${alloc.jobs.map((j) => j.job_id).join(",")}|${alloc.capacity}`;
        if (!chart || newKey !== key || !alloc.t.length) { create(alloc, data); key = newKey; }
        else chart.setData(data);
        renderLegend(alloc);
      },
    };
  }

  // -- pages ------------------------------------------------------------------------------------

  async function header() {
    for (const link of document.querySelectorAll("[data-nav]")) {
      if (link.dataset.nav === page || (page === "job" && link.dataset.nav === "jobs")) link.classList.add("active");
    }
    $("logout").addEventListener("click", async () => {
      await api("/api/logout", { method: "POST" }).catch(() => {});
      location.assign("/login");
    });
    me = await api("/api/me");
    $("whoami").textContent = `${me.principal}${me.admin ? " (admin)" : ""}`;
    shoal.me = me;
  }

  function loginPage() {
    const params = new URLSearchParams(location.search);
    $("login-form").addEventListener("submit", async (event) => {
      event.preventDefault();
      $("login-error").textContent = "";
      try {
        await api("/api/login", { body: { token: $("token").value } });
        const next = params.get("next") || "/";
        location.assign(next.startsWith("/") && !next.startsWith("//") ? next : "/");
      } catch (e) {
        $("login-error").textContent = e.message;
      }
    });
  }

  function jobsPage() {
    const alloc = allocationChart($("alloc-chart"), $("alloc-now"));
    live("/api/stream/overview", {
      overview(data) {
        shoal.state.overview = data;
        $("gpu-summary").textContent = `${data.gpus_busy} of ${data.gpus_total} GPUs in use`;
        alloc.update(data.allocation, data.server_time);
        const body = document.querySelector("#jobs tbody");
        body.textContent = "";
        for (const j of data.jobs) {
          body.append(
            el("tr", { data: { job: j.job_id, state: j.state } },
              el("td", {}, el("a", { href: `/jobs/${encodeURIComponent(j.job_id)}`, text: j.job_id })),
              el("td", { text: j.name }),
              el("td", {}, badge(j.state)),
              el("td", { class: "priority", text: j.priority }),
              el("td", { class: "workers", text: `${j.allocated_workers}/${j.max_workers}` }),
              el("td", { text: `${j.epoch}/${j.epochs}` }),
              el("td", {},
                el("span", { class: "bar" }, el("span", { style: undefined })),
                `${j.completed_iterations}${j.total_iterations ? "/" + j.total_iterations : ""}`),
              el("td", { text: fmtNum(j.last_loss) }),
              el("td", { text: j.samples_per_second ? j.samples_per_second.toFixed(0) : "-" }),
              el("td", { text: j.owner }),
            ),
          );
          body.lastChild.querySelector(".bar > span").style.width = `${Math.round(j.progress * 100)}%`;
        }
        $("jobs-empty").hidden = data.jobs.length > 0;
      },
    });
  }

  function clusterPage() {
    live("/api/stream/cluster", {
      cluster(data) {
        shoal.state.cluster = data;
        $("cluster-summary").textContent = `${data.gpus_busy} of ${data.gpus_total} GPUs in use`;
        const root = $("hosts");
        root.textContent = "";
        root.className = "hosts";
        for (const h of data.hosts) {
          const title = el("h3", {}, h.host_id, badge(h.state),
            el("span", { class: "muted", text: `${h.agent_address} · group ${h.resource_group}` }));
          if (me && me.admin && (h.state === "ready" || h.state === "cordoned")) {
            title.append(el("button", {
              type: "button", class: "danger", "data-drain": h.host_id, text: "Drain",
              onclick: () => drain(h.host_id),
            }));
          }
          const devices = el("div", { class: "devices" });
          for (const d of h.devices) {
            const holder = d.job_id
              ? el("a", { href: `/jobs/${encodeURIComponent(d.job_id)}`, text: `${d.job_id} (${d.job_name})` })
              : el("span", { class: "muted", text: d.busy ? "in use by another user's job" : "free" });
            devices.append(el("div", {
              class: `device${d.busy ? " busy" : ""}${d.healthy ? "" : " unhealthy"}`,
              data: { device: `${h.host_id}/${d.device_id}`, job: d.job_id },
            },
            el("div", {}, el("span", { class: "idx", text: `${d.device_id}` }),
              el("span", { class: "muted", text: ` #${d.index}${d.simulated ? " simulated" : ""}${d.healthy ? "" : " UNHEALTHY"}` })),
            el("div", {}, holder),
            d.learner_id ? el("div", { class: "muted", text: d.learner_id }) : null));
          }
          root.append(el("section", { class: "host", data: { host: h.host_id, state: h.state } }, title, devices));
        }
      },
    });
    async function drain(hostId) {
      if (!confirm(`Drain ${hostId}? Its learners move elsewhere at their next boundaries.`)) return;
      try { await api(`/api/hosts/${encodeURIComponent(hostId)}/drain`, { body: {} }); }
      catch (e) { problem(`Drain ${hostId}: ${e.message}`); }
    }
  }

  function jobPage() {
    const jobId = decodeURIComponent(location.pathname.split("/").pop());
    const path = encodeURIComponent(jobId);
    const its = { x: [], world: [], series: {} };
    let epochs = { x: [], series: {} };
    let markers = [];
    const charts = {};
    let current = null;
    let filled = false;
    shoal.state.metrics = { its, markers: () => markers, epochs: () => epochs };
    document.title = `shoal · ${jobId}`;
    $("model-link").href = `/api/jobs/${path}/model`;
    $("model-link").setAttribute("download", "");

    function drawMetrics() {
      const itBox = $("iteration-charts");
      for (const [name, values] of Object.entries(its.series)) {
        const key = `it:${name}`;
        const data = [its.x, values];
        if (!charts[key]) charts[key] = lineChart(itBox, name, "iteration", data, () => markers, "x");
        else charts[key].setData(data);
      }
      const epBox = $("epoch-charts");
      for (const [name, values] of Object.entries(epochs.series)) {
        const key = `ep:${name}`;
        const data = [epochs.x, values];
        if (!charts[key]) charts[key] = lineChart(epBox, name, "epoch", data, () => markers, "epoch_x");
        else charts[key].setData(data);
      }
      $("epoch-empty").hidden = epochs.x.length > 0;
      shoal.charts.metrics = charts;
    }
    window.addEventListener("resize", () => {
      for (const chart of Object.values(charts)) {
        chart.setSize({ width: chartWidth(chart.root.parentNode), height: 220 });
      }
    });

    function renderJob(data) {
      current = data.job;
      shoal.state.job = data;
      const j = data.job;
      $("job-title").textContent = `${j.job_id} · ${j.name}`;
      const state = $("job-state");
      state.textContent = j.state;
      state.className = `badge ${j.state}`;
      $("job-reason").textContent = j.state_reason;
      const facts = $("job-facts");
      facts.textContent = "";
      const fact = (k, v, id) => facts.append(el("span", { "data-fact": id }, `${k} `, el("b", { text: v })));
      fact("owner", j.owner, "owner");
      fact("priority", String(j.priority), "priority");
      fact("GPUs", `${j.allocated_workers} (target ${j.target_workers}, max ${j.max_workers})`, "workers");
      fact("epoch", `${j.epoch}/${j.epochs}`, "epoch");
      fact("iterations", `${j.completed_iterations}${j.total_iterations ? "/" + j.total_iterations : ""}`, "iterations");
      fact("loss", fmtNum(j.last_loss), "loss");
      fact("samples/s", j.samples_per_second ? j.samples_per_second.toFixed(0) : "-", "throughput");
      fact("sync", j.sync_mode, "sync");
      fact("batch", String(data.spec.batch_size), "batch");
      $("job-progress").style.width = `${Math.round(j.progress * 100)}%`;
      const form = $("job-actions");
      form.hidden = !data.can_act;
      for (const control of form.querySelectorAll("input, button")) control.disabled = j.final;
      if (!filled) {
        $("priority").value = j.priority;
        $("max-workers").value = j.max_workers;
        filled = true;
      }
      const learners = document.querySelector("#learners tbody");
      learners.textContent = "";
      if (!data.learners.length) {
        learners.append(el("tr", {}, el("td", { colspan: "4", class: "muted", text: "none now" })));
      }
      for (const l of data.learners) {
        learners.append(el("tr", { data: { learner: l.learner_id } },
          el("td", { text: l.learner_id }), el("td", { text: l.host_id }),
          el("td", { text: `${l.device_id} (#${l.device_index})` }), el("td", { text: fmtTime(l.since) })));
      }
      const allocs = document.querySelector("#allocations tbody");
      allocs.textContent = "";
      for (const a of data.allocations.slice().reverse()) {
        allocs.append(el("tr", {}, el("td", { text: fmtTime(a.time) }), el("td", { text: a.workers }),
          el("td", { text: a.target_workers }), el("td", { class: "why", text: a.reason })));
      }
    }

    function addMetrics(data) {
      if (data.offset === 0) {
        its.x.length = 0; its.world.length = 0;
        for (const k of Object.keys(its.series)) delete its.series[k];
        markers = [];
      }
      const inc = data.iterations;
      const before = its.x.length;
      its.x.push(...inc.x);
      its.world.push(...inc.world_size);
      for (const [name, values] of Object.entries(inc.series)) {
        if (!its.series[name]) its.series[name] = new Array(before).fill(null);
        its.series[name].push(...values);
      }
      for (const values of Object.values(its.series)) {
        while (values.length < its.x.length) values.push(null);
      }
      markers = markers.concat(data.markers);
      epochs = data.epochs;
      drawMetrics();
    }

    function renderCheckpoints(data) {
      const body = document.querySelector("#checkpoints tbody");
      body.textContent = "";
      for (const c of data.checkpoints) {
        const files = el("td", {});
        for (const f of c.files) {
          files.append(el("a", {
            href: `/api/jobs/${path}/checkpoints/${encodeURIComponent(c.name)}/${encodeURIComponent(f.name)}`,
            download: "", text: f.name, title: fmtBytes(f.size_bytes),
          }), " ");
        }
        body.append(el("tr", { data: { checkpoint: c.name } },
          el("td", { text: c.latest ? `${c.name} (latest)` : c.name }), el("td", { text: c.iteration }),
          el("td", { text: c.epoch }), el("td", { text: fmtTime(c.time) }),
          el("td", { text: fmtBytes(c.size_bytes) }), files));
      }
      $("checkpoints-empty").hidden = data.checkpoints.length > 0;
    }

    async function act(what, body) {
      const out = $("action-result");
      out.textContent = "…";
      out.className = "";
      try {
        const job = await api(`/api/jobs/${path}/${what}`, { body });
        out.textContent = what === "cancel" ? `${job.state}` : `priority ${job.priority}, max workers ${job.max_workers}`;
        out.className = "ok";
      } catch (e) {
        out.textContent = e.message;
        out.className = "error";
      }
    }
    const whole = (id) => {
      const raw = $(id).value.trim();
      return /^-?\d+$/.test(raw) ? Number(raw) : raw;
    };
    $("set-priority").addEventListener("click", () => act("update", { priority: whole("priority") }));
    $("set-max-workers").addEventListener("click", () => act("update", { max_workers: whole("max-workers") }));
    $("cancel").addEventListener("click", () => {
      if (confirm(`Cancel ${jobId}? Its learners stop; its checkpoints stay.`)) act("cancel", {});
    });

    live(`/api/stream/jobs/${path}`, {
      job: renderJob,
      metrics: addMetrics,
      checkpoints: renderCheckpoints,
      fatal() { $("job-actions").hidden = true; },
    });

    // Logs, followed while the box is ticked.
    const logBox = $("logs");
    let logSource = null;
    const MAX_LINES = 5000;
    function follow(on) {
      if (logSource) { logSource.close(); logSource = null; }
      if (!on) return;
      logBox.textContent = "";
      logSource = new EventSource(`/api/stream/jobs/${path}/logs?follow=1`);
      logSource.addEventListener("line", (event) => {
        const line = JSON.parse(event.data);
        const atBottom = logBox.scrollTop + logBox.clientHeight >= logBox.scrollHeight - 20;
        logBox.append(el("span", { class: line.stderr ? "stderr" : "" },
          el("span", { class: "who", text: `[${line.learner_id}] ` }), `${line.text}\n`));
        while (logBox.childNodes.length > MAX_LINES) logBox.firstChild.remove();
        if (atBottom) logBox.scrollTop = logBox.scrollHeight;
      });
      logSource.addEventListener("end", () => { logSource.close(); logSource = null; });
      logSource.addEventListener("fatal", () => { logSource.close(); logSource = null; });
    }
    $("follow").addEventListener("change", (event) => follow(event.target.checked));
    follow(true);
  }

  // -- start ------------------------------------------------------------------------------------

  async function start() {
    if (page === "login") { loginPage(); return; }
    try { await header(); } catch (e) { return; }
    if (page === "jobs") jobsPage();
    else if (page === "cluster") clusterPage();
    else if (page === "job") jobPage();
  }
  start();
})();
