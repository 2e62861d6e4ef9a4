// Headless Chromium as every dashboard script here starts it: the system
// browser (or WALSHIP_CHROMIUM), with no sandbox, GPU, background network
// or first-run work, so it starts quickly and quietly in CI.
import { chromium } from "playwright-core";

export function launch() {
  return chromium.launch({
    executablePath: process.env.WALSHIP_CHROMIUM || "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
           "--no-first-run", "--disable-component-update", "--disable-sync"],
  });
}
