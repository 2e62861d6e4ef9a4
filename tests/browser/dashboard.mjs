// Drives the coordinator's dashboard in headless Chromium the way an
// operator would: checks the shard table shows `leader` for `shard`, runs a
// failover drill with the page's button (answering the token prompt), waits
// for the report, previews a rebalance with its button, saves a
// screenshot, and prints the report and the preview as JSON.
// Usage: node dashboard.mjs <dashboard url> <token> <shard> <leader> <screenshot.png>
import { launch } from "./launch.mjs";

const [url, token, shard, leader, shot] = process.argv.slice(2);
const browser = await launch();
try {
  const page = await browser.newPage({ viewport: { width: 1400, height: 1200 } });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("dialog", (d) => (d.type() === "prompt" ? d.accept(token) : d.accept()));
  await page.goto(url);
  await page.waitForFunction(([s, l]) => {
    const row = document.querySelector(`#shards tbody tr[data-shard="${s}"]`);
    const leaderRow = document.querySelector(`#shards tbody tr[data-shard="${s}"][data-node="${l}"]`);
    return row && row.querySelector("td.leader").textContent === l
      && leaderRow && leaderRow.querySelector("td.role-leader") !== null;
  }, [shard, leader], { timeout: 30000 });
  const summary = await page.textContent("#summary");
  await page.selectOption("#action-shard", shard);
  await page.click("#drill-btn");
  await page.waitForFunction(() => {
    const t = document.querySelector("#action-output").textContent;
    return t.includes('"state": "done"') || t.includes('"state": "failed"') || t.includes("refused");
  }, null, { timeout: 90000 });
  const output = await page.textContent("#action-output");
  // The drills table shows it too once the page refreshes.
  await page.waitForSelector("#drills tbody tr[data-drill]", { timeout: 10000 });
  // Then a rebalance preview with its button.
  await page.click("#rebalance-preview-btn");
  await page.waitForFunction(() => {
    const t = document.querySelector("#action-output").textContent;
    return t.includes('"fair_share"') || t.includes("refused");
  }, null, { timeout: 30000 });
  const rebalance = await page.textContent("#action-output");
  await page.screenshot({ path: shot, fullPage: true });
  console.log(JSON.stringify({ summary, errors, report: JSON.parse(output), rebalance: JSON.parse(rebalance) }));
} finally {
  await browser.close();
}
