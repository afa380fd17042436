"""docs/optimizers.md from tests/optax_suite_outcomes.json: which optax
optimizers zero1 accepts, as optax's own shipped tests find them.

    python -m experiments.testing.optimizer_table           # rewrite docs/optimizers.md
    python -m experiments.testing.optimizer_table --check   # exit 1 if it differs

tests/test_optax_suite.py records the table (``ZERO1_OPTAX_SUITE_RECORD=1``)
and asserts the committed docs/optimizers.md is what :func:`render` makes
of the committed table.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = ROOT / "tests" / "optax_suite_outcomes.json"
DOC = ROOT / "docs" / "optimizers.md"

# suite name (the table's case prefix) -> optax's file (tests/optax_suite.py)
FILES = {
    "alias": "optax/_src/alias_test.py",
    "contrib_common": "optax/contrib/_common_test.py",
    "transform": "optax/_src/transform_test.py",
    "combine": "optax/_src/combine_test.py",
    "combining": "optax/transforms/_combining_test.py",
    "accumulation": "optax/transforms/_accumulation_test.py",
    "masking": "optax/transforms/_masking_test.py",
    "freezing": "optax/transforms/_freezing_test.py",
    "schedule_free": "optax/contrib/_schedule_free_test.py",
    "sam": "optax/contrib/_sam_test.py",
    "inject": "optax/schedules/_inject_test.py",
    "clipping": "optax/transforms/_clipping_test.py",
    "conditionality": "optax/transforms/_conditionality_test.py",
    "adding": "optax/transforms/_adding_test.py",
    "constraining": "optax/transforms/_constraining_test.py",
    "layouts": "optax/transforms/_layouts_test.py",
    "monitoring": "optax/transforms/_monitoring_test.py",
    "lookahead": "optax/_src/lookahead_test.py",
    "update": "optax/_src/update_test.py",
    "float64": "optax/_src/float64_test.py",
    "factorized": "optax/_src/factorized_test.py",
    "linesearch": "optax/_src/linesearch_test.py",
    "utils": "optax/_src/utils_test.py",
    "mechanic": "optax/contrib/_mechanic_test.py",
    "muon": "optax/contrib/_muon_test.py",
    "reduce_on_plateau": "optax/contrib/_reduce_on_plateau_test.py",
    "complex_valued": "optax/contrib/_complex_valued_test.py",
    "galore": "optax/contrib/_galore_test.py",
    "privacy": "optax/contrib/_privacy_test.py",
    "state_utils": "optax/tree_utils/_state_utils_test.py",
    "aggregating": "optax/experimental/_aggregating_test.py",
}

REASONS = {
    "refused:not-elementwise": (
        "the optimizer reads whole leaves or the whole tree (norms, factored "
        "moments, trust ratios, tree-wide scalars): under ZeRO-1 it would "
        "see 1/N of each leaf (core/elementwise.py names the operation)"),
    "refused:cannot-run": (
        "the optimizer does not fit the call zero1 makes on each device's "
        "1/N shards (init(params), update(grads, state, params) with the "
        "extra keyword arguments tx.update is given, a fixed state "
        "structure): e.g. it needs per-example gradients, a function to "
        "evaluate or an array argument (a scalar loss value= is checked at "
        "init and forwarded), or its state changes structure"),
    "refused:nest-inside": (
        "a wrapper that calls its optimizer on whole gradients and does more "
        "around it (optax.lookahead's LookaheadParams, optax.contrib.sam's "
        "adversarial step): zero1 goes inside it, around that optimizer, "
        "and the refusal names the form (tests/test_nesting.py trains both "
        "so, as optax)"),
    "refused:float16 params": (
        "fp16 params in plain jit without an explicit loss-scale choice "
        "(z1.loss_scale / z1.zero1(..., loss_scale=...)): never a silent "
        "/65,536"),
    "refused:update needs params here": (
        "tx.update(grads, state) without params, where zero1's update is "
        "computed from them: a bf16 / fp16 param (its fp32 master is in the "
        "state; the update is the new weights minus params). Without params "
        "float32 params train as with optax's update(grads, state)"),
    "refused:update's state is not zero1's but a ReduceLROnPlateauState": (
        "the test builds the inner optimizer's state itself and hands it to "
        "zero1's update"),
    "refused:update's grads are not of the params' structure this state w": (
        "the test inits on one tree (a bare scalar) and updates another (a "
        "dict): with params zero1 checks the grads against them, without "
        "against the tree the state was built for"),
    "refused:update needs the gradients": (
        "tx.update(None, state, params): nothing to reduce and update"),
}


def _kind(o: str) -> str:
  return o.split(":")[0] if ":" in o else o


def _opt(params: str) -> str | None:
  """``adam``, or ``mechanize(adam)`` where a contrib wrapper is around it."""
  m = re.search(r"opt_name='(\w+)'", params)
  if not m:
    return None
  w = re.search(r"wrapper_name='(\w+)'", params)
  return f"{w.group(1)}({m.group(1)})" if w else m.group(1)


# Refusals of the call, not of the optimizer: any optimizer gets them there.
CALL_REFUSALS = ("refused:float16 params", "refused:update needs params here",
                 "refused:update needs the gradients")


def _cell(c: collections.Counter, kind: str) -> str:
  return str(sum(n for o, n in c.items() if _kind(o) == kind) or "")


def render(table: dict) -> str:
  by_suite = collections.defaultdict(list)
  for case, row in table.items():
    by_suite[case.split("::")[0]].append((case, row))
  out = [
      "# Optimizers under zero1, as optax's own tests find them",
      "",
      "<!-- Generated by experiments/testing/optimizer_table.py from "
      "tests/optax_suite_outcomes.json: do not edit by hand. -->",
      "",
      "tests/test_optax_suite.py (`-m slow`) runs optax's shipped test files "
      "from the installed wheel with every optimizer they build wrapped as "
      "`z1.zero1(opt, axis_name=\"data\")`, in plain `jax.jit` under an "
      "8-device mesh, the tests' own assertions unchanged, and the same "
      "files unwrapped (\"optax\" below). Every case's outcome is asserted "
      "from the committed table; an outcome that changes fails the test.",
      "",
      "Outcomes: **pass** (as with optax), **refused** (zero1 raises, with "
      "the reason below, before training or at the first update that brings "
      "extra arguments), **n/a** (the test reads what "
      "zero1 changes by design, e.g. the inner optimizer's state through "
      "zero1's: `z1.inner_state(tx, state, params)` gives it), **skip** "
      "(the test skips itself), **fail** (an assertion or error).",
      "",
      "Every optax and optax.contrib transformation by name, elementwise "
      "(supported) or refused, as `z1.init`'s check finds it: "
      "[elementwise.md](elementwise.md).",
      "",
      "## Per file",
      "",
      "| file | cases | pass | refused | n/a | skip | fail | fails in optax too |",
      "|---|---|---|---|---|---|---|---|",
  ]
  tot = collections.Counter()
  for name in FILES:
    rows = by_suite.get(name, [])
    if not rows:
      continue
    z = collections.Counter(r["zero1"] for _, r in rows)
    base_bad = sum(_kind(r.get("optax", "")) in ("fail", "error")
                   for _, r in rows)
    fails = sum(n for o, n in z.items() if _kind(o) in ("fail", "error"))
    cells = [str(len(rows))] + [_cell(z, k) for k in
                                ("pass", "refused", "n/a", "skip")]
    out.append(f"| `{FILES[name]}` | " + " | ".join(cells) +
               f" | {fails or ''} | {base_bad or ''} |")
    tot.update(z)
    tot["_cases"] += len(rows)
    tot["_base_bad"] += base_bad
  out.append("| **all** | " + " | ".join(
      [str(tot["_cases"])] + [_cell(tot, k) for k in
                              ("pass", "refused", "n/a", "skip")]) +
      f" | {sum(n for o, n in tot.items() if _kind(o) in ('fail', 'error')) or ''}"
      f" | {tot['_base_bad'] or ''} |")

  out += ["", "## Per optimizer", "",
          "From the files that parameterize by optimizer name "
          "(`alias_test.py`, `contrib/_common_test.py`; `mechanize(adam)`: "
          "contrib's wrapper around it): each optimizer's cases under zero1. "
          "**trains** = no case refuses the optimizer itself (a refusal of "
          "the call, fp16 params without a loss-scale choice or update "
          "without params, can hit any optimizer: counted apart) and none "
          "fails; **partly refused** = some of its cases pass, others "
          "refuse it (read the case rows in the table); **refused** = no "
          "case passes.", "",
          "| optimizer | verdict | cases | pass | refused (why) | "
          "call refused | n/a | skip | fail |",
          "|---|---|---|---|---|---|---|---|---|"]
  per = collections.defaultdict(collections.Counter)
  for name in ("alias", "contrib_common"):
    for case, row in by_suite.get(name, []):
      opt = _opt(row.get("params", ""))
      if opt:
        per[opt][row["zero1"]] += 1
  for opt in sorted(per):
    c = per[opt]
    own = {o: n for o, n in c.items()
           if _kind(o) == "refused" and o not in CALL_REFUSALS}
    why = sorted({o.split(":", 1)[1] for o in own})
    call = sum(n for o, n in c.items() if o in CALL_REFUSALS)
    fail = sum(n for o, n in c.items() if _kind(o) in ("fail", "error"))
    verdict = ("fails" if fail else "refused" if own and not _cell(c, "pass")
               else "partly refused" if own else "trains")
    ref = f"{sum(own.values())} ({', '.join(why)})" if own else ""
    out.append(f"| `{opt}` | {verdict} | {sum(c.values())} | "
               f"{_cell(c, 'pass')} | {ref} | {call or ''} | "
               f"{_cell(c, 'n/a')} | {_cell(c, 'skip')} | {fail or ''} |")

  out += ["", "## Refusals", "", "| reason | cases | what it means |",
          "|---|---|---|"]
  for o, n in sorted(tot.items()):
    if _kind(o) == "refused":
      out.append(f"| `{o}` | {n} | {REASONS.get(o, '')} |")
  out += ["", "## Not applicable", "", "| why | cases |", "|---|---|"]
  for o, n in sorted(tot.items()):
    if _kind(o) == "n/a":
      out.append(f"| {o[4:]} | {n} |")
  bad = [(c, r) for c, r in sorted(table.items())
         if _kind(r.get("optax", "")) in ("fail", "error")]
  out += ["", "## Cases that fail in optax itself", "",
          "With this optax and jax, unwrapped, under the same mesh "
          "(what zero1 does there is recorded too):", "",
          "| case | optax | zero1 |", "|---|---|---|"]
  out += [f"| `{c}` | {r['optax']} | {r['zero1']} |" for c, r in bad]
  return "\n".join(out) + "\n"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--check", action="store_true")
  a = ap.parse_args(argv)
  text = render(json.loads(TABLE.read_text()))
  if a.check:
    same = DOC.exists() and DOC.read_text() == text
    print("docs/optimizers.md is up to date" if same else
          "docs/optimizers.md differs: python -m experiments.testing.optimizer_table")
    return 0 if same else 1
  DOC.write_text(text)
  print(f"wrote {DOC.relative_to(ROOT)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
