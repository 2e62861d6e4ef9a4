// Opens the coordinator's dashboard on a cluster with more shards than one
// page and pages through the shard table the way an operator would: the
// first page, the next one, then only the shards needing attention.
// Prints what each view showed as JSON.
// Usage: node pages.mjs <dashboard url>
import { launch } from "./launch.mjs";

const [url] = process.argv.slice(2);
const browser = await launch();
try {
  const page = await browser.newPage({ viewport: { width: 1400, height: 1200 } });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  await page.goto(url);
  const view = () => page.evaluate(() => ({
    label: document.querySelector("#shards-page").textContent,
    shards: [...new Set([...document.querySelectorAll("#shards tbody tr")].map(r => r.dataset.shard))].map(Number),
    summary: document.querySelector("#summary").textContent,
  }));
  await page.waitForFunction(() => document.querySelector("#shards-page").textContent.startsWith("page 1 of"),
    null, { timeout: 30000 });
  const first = await view();
  await page.click("#shards-next");
  await page.waitForFunction(() => document.querySelector("#shards-page").textContent.startsWith("page 2 of"),
    null, { timeout: 10000 });
  const second = await view();
  await page.check("#shards-unhealthy");
  await page.waitForFunction(() => document.querySelector("#shards-page").textContent.includes("needing attention"),
    null, { timeout: 10000 });
  const attention = await view();
  console.log(JSON.stringify({ errors, first, second, attention }));
} finally {
  await browser.close();
}
