"""`make dist`'s checks on what it built: one wheel and one sdist of the
package's version, the wheel holding the zero1_jax package and its two
console scripts and nothing of tests/ or experiments/."""

import glob
import re
import sys
import tarfile
import zipfile


def main(dist: str = "dist") -> int:
  sys.path.insert(0, ".")
  import zero1_jax
  version = zero1_jax.__version__
  wheels = glob.glob(f"{dist}/zero1_jax-{version}-py3-none-any.whl")
  sdists = glob.glob(f"{dist}/zero1_jax-{version}.tar.gz")
  if len(wheels) != 1 or len(sdists) != 1:
    print(f"check_dist: expected one wheel and one sdist of {version} in "
          f"{dist}/, found {sorted(glob.glob(dist + '/*'))}")
    return 1
  names = zipfile.ZipFile(wheels[0]).namelist()
  top = {n.split("/", 1)[0] for n in names}
  stray = sorted(t for t in top if t not in (
      "zero1_jax", f"zero1_jax-{version}.dist-info"))
  entry = zipfile.ZipFile(wheels[0]).read(
      f"zero1_jax-{version}.dist-info/entry_points.txt").decode()
  problems = []
  if stray:
    problems.append(f"the wheel holds {stray} besides the package")
  for script in ("zero1-train", "zero1-export"):
    if not re.search(rf"^{script} = ", entry, re.M):
      problems.append(f"the wheel has no {script} console script")
  for must in ("zero1_jax/__init__.py", "zero1_jax/cli/train.py",
               "zero1_jax/core/transform.py", "zero1_jax/deepspeed/engine.py",
               "zero1_jax/inspect/gpu_specs/h100_sxm.txtpb",
               "zero1_jax/inspect/gpu_specs/h200.txtpb"):
    if must not in names:
      problems.append(f"the wheel lacks {must}")
  members = tarfile.open(sdists[0]).getnames()
  if not any(m.endswith("/pyproject.toml") for m in members):
    problems.append("the sdist has no pyproject.toml")
  for p in problems:
    print("check_dist:", p)
  if not problems:
    print(f"check_dist: {wheels[0]} ({len(names)} files) and {sdists[0]} "
          f"({len(members)} members) ok")
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
