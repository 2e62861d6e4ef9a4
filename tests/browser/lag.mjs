// Opens the coordinator's dashboard in headless Chromium.
// `catchup` mode runs a catch-up drill from the page's button (1 MiB, pausing
// the given follower, answering the token prompt) and prints its report;
// `reseed` mode does the same with the re-seed drill's button (1 MiB, wiping
// the given follower) and also prints its row in the re-seed drills table.
// `inspect` mode reports what an operator sees on the first render: the lag
// chart (drawn from the coordinator's history, so not empty on open), its
// time axis and legend, the per-node panel and the catch-up drills table.
// Both save a screenshot.
// Usage: node lag.mjs catchup|reseed <dashboard url> <token> <follower> <screenshot.png>
//        node lag.mjs inspect <dashboard url> <screenshot.png>
import { launch } from "./launch.mjs";

const mode = process.argv[2];
const drill = mode === "catchup" || mode === "reseed";
const [url, token, follower, shot] = drill ? process.argv.slice(3)
  : [process.argv[3], null, null, process.argv[4]];
const browser = await launch();
try {
  const page = await browser.newPage({ viewport: { width: 1400, height: 1800 } });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("dialog", (d) => (d.type() === "prompt" ? d.accept(token) : d.accept()));
  await page.goto(url);
  if (drill) {
    await page.waitForSelector(`#catchup-follower option[value="${follower}"]`, { state: "attached", timeout: 30000 });
    await page.fill("#catchup-mib", "1");
    await page.selectOption("#catchup-follower", follower);
    await page.click(mode === "catchup" ? "#catchup-btn" : "#reseed-btn");
    await page.waitForFunction(() => {
      const t = document.querySelector("#action-output").textContent;
      return t.includes('"state": "done"') || t.includes('"state": "failed"') || t.includes("refused");
    }, null, { timeout: 90000 });
    const output = await page.textContent("#action-output");
    const table = mode === "catchup" ? "#catchups" : "#reseeds";
    // The table is redrawn by the page's periodic refresh, which may lag the
    // button's answer: wait until the drill's row shows the answered state.
    const report = JSON.parse(output);
    if (report.id) {
      await page.waitForFunction(([sel, id, state]) => {
        const r = document.querySelector(`${sel} tbody tr[data-drill="${id}"]`);
        return r && r.cells[2] && r.cells[2].textContent.startsWith(state);
      }, [table, report.id, report.state], { timeout: 10000 });
    } else {
      await page.waitForSelector(`${table} tbody tr[data-drill]`, { timeout: 10000 });
    }
    const rows = await page.evaluate((sel) => Object.fromEntries([...document.querySelectorAll(sel)].map(r =>
      [r.dataset.drill, [...r.cells].map(c => c.textContent)])), `${table} tbody tr`);
    await page.screenshot({ path: shot, fullPage: true });
    console.log(JSON.stringify({ errors, report: JSON.parse(output), rows }));
    process.exit(0);
  }
  // The first refresh has rendered (the summary is written last).
  await page.waitForFunction(() => document.querySelector("#summary").textContent !== "loading…", null, { timeout: 30000 });
  const first = await page.evaluate(() => {
    // Points per node, and of them in stale (dashed) stretches.
    const points = {}, stale = {};
    for (const l of document.querySelectorAll("#lag-chart polyline")) {
      const n = l.getAttribute("points").trim().split(/\s+/).length;
      points[l.dataset.node] = (points[l.dataset.node] || 0) + n;
      if (l.classList.contains("stale")) stale[l.dataset.node] = (stale[l.dataset.node] || 0) + n;
    }
    return { series: Object.keys(points), points, stale };
  });
  const result = await page.evaluate(() => {
    const texts = (sel) => [...document.querySelectorAll(sel)].map(e => e.textContent);
    const row = (sel) => Object.fromEntries([...document.querySelectorAll(sel)].map(r =>
      [r.dataset.node || r.dataset.drill || r.dataset.worker || r.dataset.task, [...r.cells].map(c => c.textContent)]));
    return {
      x_ticks: texts("#lag-chart text.x-tick"),
      y_ticks: texts("#lag-chart text.y-tick"),
      legend: texts("#lag-legend .item"),
      legend_colours: [...document.querySelectorAll("#lag-legend .swatch")].map(s => s.style.background),
      nodes: row("#nodes tbody tr"),
      catchups: row("#catchups tbody tr"),
      shard_rows: row("#shards tbody tr"),
      workers: row("#workers tbody tr"),
      tasks: row("#tasks tbody tr"),
      summary: document.querySelector("#summary").textContent,
    };
  });
  await page.screenshot({ path: shot, fullPage: true });
  console.log(JSON.stringify({ errors, first, ...result }));
} finally {
  await browser.close();
}
