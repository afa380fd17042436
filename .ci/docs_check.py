"""The built docs site (site/) as a reader's browser shows it: `make docs-check`.

Serves site/ on 127.0.0.1 and opens every page in headless Chromium (Debian's
package, /usr/bin/chromium; .ci/install-chromium.sh installs it), at a desktop
and a phone width, and fails on:

- horizontal overflow: the document scrolls sideways
  (``scrollWidth > clientWidth``), or an element reaches past the viewport
  without a scrolling box around it that fits; on the API page also a
  signature that needs a scroll bar (signatures wrap, black at line_length);
- code not highlighted at build time: a ``<pre>`` outside Pygments'
  ``.highlight`` block, a python block without token spans, a highlight.js
  class, or a ``<script src>`` not served from site/;
- cross-references left as text (``:func:`...```) or in-page links whose
  anchor does not exist;
- any request that leaves the machine. Every request the pages make is logged
  (Playwright's request events), and Chromium's own traffic goes through a
  proxy on 127.0.0.1 that logs and refuses everything (Chromium sends
  127.0.0.1 direct); a URL of another host in either log fails the check;
- a JavaScript error on a page.

It saves screenshots of the home, forms and API pages under
site/_screenshots/ (kept with the build, never committed: site/ is ignored)
for a person to review.

Playwright for Python drives Chromium: kept by Microsoft, released monthly,
and it takes the system's browser (``executable_path``), so nothing is
downloaded (``playwright install`` is never run). Its request events and
``screenshot(full_page=True)`` would be a few hundred lines over the raw
DevTools protocol.

  python .ci/docs_check.py [--site site] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import socketserver
import sys
import tempfile
import threading
import urllib.parse
from pathlib import Path

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
# Chromium as root in a container, no GPU, nothing started in the background;
# QUIC off so that every request is HTTP the proxy sees. Three services ignore
# those switches (Chromium 156 fetched the on-device-model manifest "on
# demand" past --disable-component-update, asked accounts.google.com for the
# signed-in accounts, and, with the Google API keys Debian's launcher reads
# from /etc/chromium.d, content-autofill.googleapis.com): their servers are
# set to 127.0.0.1's port 9, where nothing listens.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync",
                  "--disable-default-apps", "--disable-extensions",
                  "--component-updater=url-source=http://127.0.0.1:9/",
                  "--gaia-url=http://127.0.0.1:9/",
                  "--autofill-server-url=http://127.0.0.1:9/"]
WIDTHS = {"desktop": (1280, 900), "phone": (390, 844)}
SCREENSHOTS = {"home": "index.html", "forms": "forms/index.html",
               "api": "api/index.html"}
# the API page is tens of thousands of px tall: its top 7000 px
MAX_SHOT_HEIGHT = 7000


class _Quiet(http.server.SimpleHTTPRequestHandler):
  def log_message(self, *args):
    pass


class _Refuse(http.server.BaseHTTPRequestHandler):
  """The proxy: every request Chromium sends past 127.0.0.1 lands here,
  is logged, and gets a 403."""
  seen: list[str] = []

  def _refuse(self):
    self.seen.append(f"{self.command} {self.path}")
    self.send_response(403)
    self.send_header("Content-Length", "0")
    self.end_headers()

  do_GET = do_POST = do_HEAD = do_PUT = do_OPTIONS = do_CONNECT = _refuse

  def log_message(self, *args):
    pass


def _serve(handler) -> socketserver.TCPServer:
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  return server


def _is_local(url: str) -> bool:
  u = urllib.parse.urlsplit(url)
  if u.scheme in ("data", "blob", "about", "chrome", "chrome-error", "devtools"):
    return True
  return (u.hostname or "") in LOCAL_HOSTS


# What one page shows, measured in the page (returns a dict of problems)
PAGE_JS = r"""
(isApi) => {
  const vw = document.documentElement.clientWidth;
  const snip = (t) => (t || "").trim().replace(/\s+/g, " ").slice(0, 60);
  const describe = (el) => {
    const r = el.getBoundingClientRect();
    const cls = typeof el.className === "string" && el.className
        ? "." + el.className.trim().split(/\s+/).join(".") : "";
    const text = snip(el.textContent);
    return `<${el.tagName.toLowerCase()}${el.id ? "#" + el.id : ""}${cls}> ` +
           `right edge ${Math.round(r.right)} px > ${vw} px: "${text}"`;
  };
  const out = {overflow: [], code: [], refs: [], stats: {}};
  const root = document.documentElement;
  if (root.scrollWidth > root.clientWidth)
    out.overflow.push(`the page scrolls sideways: scrollWidth ${root.scrollWidth} > clientWidth ${root.clientWidth}`);
  for (const el of document.body.querySelectorAll("*")) {
    if (!el.checkVisibility({opacityProperty: true, visibilityProperty: true}))
      continue;                        // closed search panel, hidden tabs
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.height === 0 || r.right <= vw + 1) continue;
    if (r.left >= vw || r.right <= 0) continue;        // off-canvas drawers
    // fine when a box around it that fits the viewport scrolls or clips it
    // (Material's table wrapper, a code block)
    let a = el.parentElement, box = null;
    while (a && a !== document.body) {
      const sa = getComputedStyle(a);
      if ((sa.overflowX !== "visible" || sa.position === "fixed") &&
          a.getBoundingClientRect().right <= vw + 1) { box = a; break; }
      a = a.parentElement;
    }
    if (!box) out.overflow.push(describe(el));
  }
  // boxes a reader scrolls sideways (wide tables, long code lines): counted
  out.stats.scrolling_boxes = [...document.querySelectorAll(
      ".md-content pre > code, .md-content .md-typeset__scrollwrap")]
      .filter((b) => b.scrollWidth > b.clientWidth + 1).length;
  const pres = [...document.querySelectorAll(".md-content pre")];
  out.stats.code_blocks = pres.length;
  out.stats.highlighted = 0;
  for (const pre of pres) {
    const hl = pre.closest(".highlight");
    const spans = pre.querySelectorAll("code span[class]").length;
    if (spans) out.stats.highlighted++;
    if (!hl) out.code.push(`<pre> outside a Pygments .highlight block: "${snip(pre.textContent)}"`);
    const code = pre.querySelector("code");
    const lang = hl ? hl.className + " " + (code ? code.className : "") : "";
    if (hl && /language-(python|pycon|py)\b/.test(lang) && !spans)
      out.code.push(`python block without Pygments spans: "${snip(pre.textContent)}"`);
    if (pre.querySelector(".hljs, [class^=hljs-]")) out.code.push("highlight.js markup");
  }
  for (const s of document.querySelectorAll("script[src]"))
    if (new URL(s.src, location.href).host !== location.host)
      out.code.push(`script from another host: ${s.src}`);
  const text = document.querySelector(".md-content").innerText;
  // a role as mkdocstrings printed it: ":func:" then the name (in code)
  const roles = text.match(/:(func|meth|class|mod|data|attr|obj|exc|const):`?[\w.~]+/g) || [];
  for (const r of roles) out.refs.push(`role left as text: ${r}`);
  for (const a of document.querySelectorAll(".md-content a[href^='#']")) {
    const id = decodeURIComponent(a.getAttribute("href").slice(1));
    if (id && !document.getElementById(id)) out.refs.push(`link to a missing anchor #${id}`);
  }
  out.stats.autorefs = document.querySelectorAll(".md-content a.autorefs-internal").length;
  if (isApi && vw >= 1000) {      // on a phone a signature scrolls, as code does
    out.stats.signatures = 0;
    for (const pre of document.querySelectorAll(".doc-signature pre")) {
      out.stats.signatures++;
      const code = pre.querySelector("code") || pre;
      if (code.scrollWidth > pre.clientWidth + 1)
        out.overflow.push(`signature needs a scroll bar (${code.scrollWidth} > ${pre.clientWidth} px): "${snip(pre.textContent)}"`);
    }
  }
  return out;
}
"""


def check(site: Path, chromium: str) -> int:
  from playwright.sync_api import sync_playwright

  pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("index.html")
                 if "_screenshots" not in p.parts)
  if "index.html" not in pages or "api/index.html" not in pages:
    print(f"docs-check: {site} has no built site (run `make docs` first)")
    return 2
  web = _serve(functools.partial(_Quiet, directory=str(site)))
  proxy = _serve(_Refuse)
  base = f"http://127.0.0.1:{web.server_address[1]}/"
  shots = site / "_screenshots"
  shots.mkdir(exist_ok=True)
  requests: list[str] = []
  problems: list[str] = []
  totals = {"pages": 0, "code_blocks": 0, "highlighted": 0, "autorefs": 0}
  scrolling: list[str] = []   # pages with a table or code box that scrolls
  profile = tempfile.mkdtemp(prefix="docs-check-profile-")
  try:
    with sync_playwright() as pw:
      context = pw.chromium.launch_persistent_context(
          profile, executable_path=chromium, headless=True,
          args=CHROMIUM_FLAGS + [f"--proxy-server=http://127.0.0.1:{proxy.server_address[1]}"],
          viewport={"width": WIDTHS["desktop"][0], "height": WIDTHS["desktop"][1]},
          service_workers="block")
      context.on("request", lambda r: requests.append(r.url))
      page = context.new_page()
      errors: list[str] = []
      page.on("pageerror", lambda e: errors.append(str(e)))
      page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
      for rel in pages:
        for width, (w, h) in WIDTHS.items():
          page.set_viewport_size({"width": w, "height": h})
          errors.clear()
          page.goto(base + rel, wait_until="networkidle")
          found = page.evaluate(PAGE_JS, rel == "api/index.html")
          where = f"{rel} ({width}, {w} px)"
          for kind in ("overflow", "code", "refs"):
            problems += [f"{where}: {p}" for p in found[kind]]
          problems += [f"{where}: JavaScript error: {e}" for e in errors]
          if width == "desktop":
            totals["pages"] += 1
            for k in ("code_blocks", "highlighted", "autorefs"):
              totals[k] += found["stats"][k]
            if found["stats"]["scrolling_boxes"]:
              scrolling.append(f"{rel} ({found['stats']['scrolling_boxes']})")
            if rel == "api/index.html":
              totals["signatures"] = found["stats"]["signatures"]
        for name, target in SCREENSHOTS.items():
          if target == rel:
            page.set_viewport_size({"width": WIDTHS["desktop"][0],
                                    "height": WIDTHS["desktop"][1]})
            page.goto(base + rel, wait_until="networkidle")
            height = page.evaluate("document.documentElement.scrollHeight")
            page.screenshot(path=str(shots / f"{name}.png"), full_page=True,
                            clip={"x": 0, "y": 0, "width": WIDTHS["desktop"][0],
                                  "height": min(height, MAX_SHOT_HEIGHT)})
            page.set_viewport_size({"width": WIDTHS["phone"][0],
                                    "height": WIDTHS["phone"][1]})
            page.goto(base + rel, wait_until="networkidle")
            page.screenshot(path=str(shots / f"{name}-phone.png"))
      context.close()
  finally:
    web.shutdown()
    proxy.shutdown()
    shutil.rmtree(profile, ignore_errors=True)
  outside = sorted({u for u in requests if not _is_local(u)} | set(_Refuse.seen))
  problems += [f"request leaving the machine: {u}" for u in outside]
  if not totals["highlighted"]:
    problems.append("no highlighted code block on any page")
  if totals.get("signatures", 0) < 10 or totals["autorefs"] < 20:
    problems.append(f"the API page looks empty: {totals}")
  print(f"docs-check: {totals['pages']} pages at {len(WIDTHS)} widths, "
        f"{len(requests)} requests ({len(outside)} leaving the machine), "
        f"{totals['code_blocks']} code "
        f"blocks ({totals['highlighted']} with Pygments spans), "
        f"{totals['autorefs']} cross-references, {totals.get('signatures')} "
        f"API signatures; screenshots in {shots}")
  if scrolling:   # not a failure: the box scrolls, the page does not
    print(f"docs-check: boxes that scroll sideways at {WIDTHS['desktop'][0]} px "
          f"(wide tables or code lines): {', '.join(scrolling)}")
  for p in problems:
    print(f"docs-check: {p}")
  return 1 if problems else 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--site", default="site", type=Path)
  p.add_argument("--chromium", default="/usr/bin/chromium")
  args = p.parse_args(argv)
  if not os.access(args.chromium, os.X_OK):
    print(f"docs-check: no Chromium at {args.chromium}: install Debian's "
          f"package (bash .ci/install-chromium.sh, as root)")
    return 2
  return check(args.site, args.chromium)


if __name__ == "__main__":
  sys.exit(main())
