# kvbench: the entry points. `just --list` shows them with their descriptions.

set shell := ["bash", "-euo", "pipefail", "-c"]
# Recipes see their arguments as "$@", so quoted arguments (a prompt) stay whole.
set positional-arguments

# List the recipes.
default:
    @just --list

# Fetch real model weights into models/, checked by sha256 (idempotent; known: smollm2; --check only checks).
fetch-model name="smollm2" *args:
    scripts/fetch-model.sh "$@"

# Fetch the full evaluation data into data/ (or $KVBENCH_DATASETS_DIR) from its public sources, every file checked by sha256 (idempotent; --from DIR installs from an offline copy, --check only checks).
fetch-data *args:
    python3 scripts/fetch-data.py "$@"

# Build the kvbench binary in release mode.
build:
    cargo build --release -p kvbench

# One prompt through one engine, e.g. just generate --model smollm2-135m-instruct --prompt "Hi"
generate *args:
    @cargo run --quiet --release -p kvbench -- generate "$@"

# List named models and presets with their architecture numbers.
models *args:
    @cargo run --quiet --release -p kvbench -- models "$@"

# Formatting, lints and every test: what CI runs.
test: (fetch-model "smollm2")
    cargo fmt --all --check
    cargo clippy --all-targets -- -D warnings
    cargo test --release --workspace

# Tests on the full evaluation data (`just test` reads only the committed fixtures); fails, naming what is missing, before `just fetch-data`.
test-full-data:
    python3 scripts/fetch-data.py --check
    cargo test --release -p kvbench-datasets --test full_data --test fetch_data -- --ignored

# Run an experiment: NAME under experiments/ without .yaml (cpu/quickstart) or a YAML path; each cell in its own process, results in results/<name>/ (resumable; --dry-run, --shard i/n, --force, --tables-only).
run-experiment name *args: build
    @"${CARGO_TARGET_DIR:-target}/release/kvbench" run "$@"

# Criterion benches: `just bench` decode vs candle's quantized llama; `just bench policies` one step per strategy.
bench which="decode" *args: (fetch-model "smollm2")
    #!/usr/bin/env bash
    set -euo pipefail
    shift
    cargo bench -p kvbench-engines --bench "{{which}}" -- "$@"

# Lint the code behind the `cuda` feature without a GPU (clippy with nvcc from the Python registry; no link): what CI runs after `just test`.
check-cuda:
    scripts/check-cuda.sh

# The GPU machine's scripts run here with stand-ins (Nsight Compute, the card, the CUDA kvbench and its libraries): the profile's kernels counted, raw CSVs kept, one decode step per pair summarized; the campaign's opt-in graph steps skipped alone while their verify fails (seconds; no GPU).
check-gpu-scripts:
    scripts/check-gpu-scripts.sh

# Build the CUDA kvbench (sm_90) here, without a GPU: target/cuda/kvbench-cuda.tar.xz (docs/cuda.md).
build-cuda:
    scripts/build-cuda.sh

# The new CUDA kernels' lane and fragment arithmetic (and the pipelined decode's cp.async schedule) transcribed in NumPy and checked against attention computed directly, the decode's reduction folded into its partition kernel against the launched one, InfiniGen's token-order gather against its head order, the device's greedy choice against the host's rule, and the few-row products' rows, chunks and output places against a plain product (no GPU; the CUDA code itself is checked by `kvbench verify --device cuda` on a GPU).
emulate-kernels:
    python3 scripts/emulate/flash_mma.py
    python3 scripts/emulate/paged_decode_vec.py
    python3 scripts/emulate/paged_decode_pipe.py
    python3 scripts/emulate/paged_decode_mma.py
    python3 scripts/emulate/decode_fold.py
    python3 scripts/emulate/ig_gather_tokens.py
    python3 scripts/emulate/argmax.py
    python3 scripts/emulate/gemv.py

# The GPU plan as resumable steps of under 9 minutes (verify, then the sweeps): on the GPU machine `just gpu-campaign OUTDIR`; anywhere `just gpu-campaign --dry-run` lists the steps and checks their YAML.
gpu-campaign *args:
    scripts/gpu-campaign.sh "$@"

# On the GPU machine: run the CUDA kvbench from its archive, e.g. just gpu-run verify --device cuda --model preset:llama-3.1-8b
gpu-run *args:
    scripts/gpu-run.sh target/cuda/kvbench-cuda.tar.xz results "$@"

# Figures of an experiment as PNG + SVG in results/EXP/figures/: EXP is a results directory or a name under results/ (--figures fig1,fig3; --out DIR).
figures exp *args: build
    @"${CARGO_TARGET_DIR:-target}/release/kvbench" plot "$@"

# CI regression sweep: run experiments/ci/sweep.yaml (one thread) into results/ci/ and compare it with the committed results/baselines/ci/ci-sweep/, timings relative to `full` (extra args go to compare, e.g. --tolerance 80%).
ci-sweep *args: build
    #!/usr/bin/env bash
    set -euo pipefail
    kvbench="${CARGO_TARGET_DIR:-target}/release/kvbench"
    rm -rf results/ci/ci-sweep
    "$kvbench" --threads 1 run experiments/ci/sweep.yaml --results results/ci
    "$kvbench" compare results/baselines/ci/ci-sweep results/ci/ci-sweep --relative-to full "$@"

# Report of an experiment: results/EXP/report.md and a self-contained report.html (environment, grid, cells, figures, the study's claims C1–C11 judged on the data); run `just figures EXP` first.
report exp: build
    @"${CARGO_TARGET_DIR:-target}/release/kvbench" report "$1"

# The cost model's calibrations and validation, rebuilt from the committed baselines: results/baselines/{cpu,h100,h200}/calibration-*.yaml and docs/cost-validation.md (each calibration predicts experiments it was not fitted on).
validate-cost: build
    #!/usr/bin/env bash
    set -euo pipefail
    kvbench="${CARGO_TARGET_DIR:-target}/release/kvbench"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$kvbench" calibrate results/baselines/cpu/cpu-batch-scaling --device cpu \
        -o results/baselines/cpu/calibration-cpu.yaml \
        --validate results/baselines/cpu/cpu-output-scaling results/baselines/cpu/cpu-quickstart \
        --table "$tmp/cpu.md" > "$tmp/cpu.log"
    # H100, the engine of the fourth lease (build d4a05e2f: FlashAttention-2 prefill,
    # the vector paged decode, the fused forms; before CUDA graphs): fitted on the
    # paradigms' full and h2o cells and the 16K/32K prefill cells, all of that build; it
    # predicts InfiniGen's cells (held out, two later builds), the fused forms' cells
    # (the same build, another experiment) and the next build's decode with CUDA graphs.
    # The fitted experiments are copies (the YAML and the requests, runs and steps
    # tables) kept where no campaign step writes: the study's sweep reruns
    # gpu-paradigms on its own build.
    h100=results/baselines/h100
    fit100=$h100/calibration-cells/d4a05e2f
    "$kvbench" calibrate $fit100/gpu-paradigms $fit100/gpu-prefill-kernel \
        --device h100-sxm --engines full,h2o --ceilings $h100/ceilings.json \
        -o $h100/calibration-h100-sxm.yaml \
        --validate $fit100/gpu-paradigms $h100/fused-projections/on/gpu-fused-projections \
        $h100/decode-graph/on/gpu-decode-graph --table "$tmp/h100-now.md" > "$tmp/h100-now.log"
    # H100, the first builds: the full cells of gpu-batch-scaling were recorded before
    # the engine synchronized the GPU after each forward: their per-step times are not
    # their own (NOTES.md). Copies of the three experiments, as the study's sweeps will
    # run them again on its build.
    first100=$h100/calibration-cells/first-builds
    "$kvbench" calibrate $first100/gpu-batch-scaling --device h100-sxm --engines h2o \
        --ceilings $h100/ceilings.json \
        -o $h100/calibration-h100-sxm-first-build.yaml \
        --validate $first100/gpu-ttft $first100/gpu-smoke --table "$tmp/h100.md" > "$tmp/h100.log"
    # H200, the current engine (vector paged decode, mma.sync prefill): fitted on the
    # paradigms at batch 32 and the 16K/32K prefill cells, it predicts the decode-kernel
    # cells (batch 1 and 16, another experiment); a second fit on full and h2o alone
    # predicts infinigen at batch 32 (held out).
    # The 16K/32K prefill cells are read from a copy of their tables: the campaign's
    # prefill-mma step, run again, would replace them with another build's.
    h200=results/baselines/h200
    "$kvbench" calibrate $h200/gpu-paradigms-batch32 $h200/calibration-cells/third-lease/gpu-prefill-kernel \
        --device h200 --ceilings $h200/ceilings.json -o $h200/calibration-h200.yaml \
        --validate $h200/decode-kernel/vector/gpu-decode-kernel \
        --table "$tmp/h200-now.md" > "$tmp/h200-now.log"
    # H200, the first build (scalar paged decode, WMMA prefill): every modelled cell of
    # the paradigms at batch 16 predicts the TTFT grid and the anchors' decode.
    "$kvbench" calibrate $h200/gpu-paradigms-batch16 --device h200 \
        --ceilings $h200/ceilings.json -o $h200/calibration-h200-first-build.yaml \
        --validate $h200/gpu-ttft-flash $h200/gpu-anchors \
        --table "$tmp/h200-other.md" > "$tmp/h200.log" 2> "$tmp/h200.err"
    # InfiniGen held out, on each build: fitted on full and h2o alone, with the host link
    # at the pinned copy rate measured on the card, then at the link rate the other
    # build's calibration fitted on its own InfiniGen cells (the gather kernel is the
    # same in both builds; the batch and the decode kernel are not).
    now=($h200/gpu-paradigms-batch32 $h200/calibration-cells/third-lease/gpu-prefill-kernel)
    "$kvbench" calibrate "${now[@]}" --device h200 --engines full,h2o --ceilings $h200/ceilings.json \
        -o "$tmp/h200-now-full-h2o.yaml" \
        --validate $h200/gpu-paradigms-batch32 --table "$tmp/h200-now-ig.md" > "$tmp/h200-now-ig.log"
    "$kvbench" calibrate "${now[@]}" --device h200 --engines full,h2o --ceilings $h200/ceilings.json \
        --rates-from $h200/calibration-h200-first-build.yaml -o "$tmp/h200-now-full-h2o-link.yaml" \
        --validate $h200/gpu-paradigms-batch32 --table "$tmp/h200-now-ig-link.md" > "$tmp/h200-now-ig-link.log"
    "$kvbench" calibrate $h200/gpu-paradigms-batch16 --device h200 --engines full,h2o \
        --ceilings $h200/ceilings.json \
        -o "$tmp/h200-full-h2o.yaml" --validate $h200/gpu-paradigms-batch16 \
        --table "$tmp/h200.md" > "$tmp/h200-held-out.log"
    "$kvbench" calibrate $h200/gpu-paradigms-batch16 --device h200 --engines full,h2o \
        --ceilings $h200/ceilings.json --rates-from $h200/calibration-h200.yaml \
        -o "$tmp/h200-full-h2o-link.yaml" --validate $h200/gpu-paradigms-batch16 \
        --table "$tmp/h200-link.md" > "$tmp/h200-held-out-link.log"
    {
        echo "# The cost model against measurements it was not fitted on"
        echo
        echo "Generated by \`just validate-cost\` from the committed baselines; docs/cost-model.md §12 reads it."
        echo "Each calibration is fitted to the steps of one experiment and predicts the cells of others measured on the same machine."
        echo
        echo "## CPU (2-core development machine)"
        echo
        echo '```text'
        grep -E "^(prefill|decode):" "$tmp/cpu.log"
        echo '```'
        echo
        cat "$tmp/cpu.md"
        echo "## H100 (results/baselines/h100, one H100 80GB HBM3), the engine of the fourth lease"
        echo
        echo "The calibration (calibration-h100-sxm.yaml), fitted on the full and h2o cells of gpu-paradigms and the FlashAttention-2 prefill cells of gpu-prefill-kernel (16K and 32K tokens; copies of both tables as that build left them, calibration-cells/d4a05e2f/), all recorded by build d4a05e2f (FlashAttention-2 prefill, vector paged decode, fused forms, before CUDA graphs). The host link keeps the rate measured on the card (pinned copies, ceilings.json): gpu-paradigms' infinigen rows (recorded by two later builds) are held out, its full and h2o rows are the fit's own cells; gpu-fused-projections is the same build's, gpu-decode-graph the next build's with CUDA graphs on:"
        echo
        echo '```text'
        grep -E "^(prefill|decode):" "$tmp/h100-now.log"
        echo '```'
        echo
        cat "$tmp/h100-now.md"
        echo "## H100, the first builds"
        echo
        echo "Before the GPU was synchronized after each forward and before issue 18's kernels (calibration-h100-sxm-first-build.yaml), fitted on gpu-batch-scaling's h2o cells (this experiment and the two it predicts read from copies of their tables, calibration-cells/first-builds/):"
        echo
        echo '```text'
        grep -E "^(prefill|decode):" "$tmp/h100.log"
        echo '```'
        echo
        cat "$tmp/h100.md"
        echo "## H200 (results/baselines/h200, one H200), the current engine"
        echo
        echo "The calibration (calibration-h200.yaml), fitted on gpu-paradigms-batch32 and the flash prefill cells of gpu-prefill-kernel (16K and 32K tokens), both recorded with the vector paged decode and mma.sync prefill kernels:"
        echo
        echo '```text'
        grep -E "^(prefill|decode):" "$tmp/h200-now.log"
        echo '```'
        echo
        cat "$tmp/h200-now.md"
        echo "Fitted on the full and h2o cells of the same two experiments, so the host link keeps the rate measured on the card (pinned copies, ceilings.json): the infinigen row is held out, the full and h2o rows are the fit's own cells."
        echo
        cat "$tmp/h200-now-ig.md"
        echo "The same fit, the host link taken from the first build's calibration (fitted on gpu-paradigms-batch16's InfiniGen cell, another experiment):"
        echo
        echo '```text'
        grep -E "^decode:" "$tmp/h200-now-ig-link.log"
        echo '```'
        echo
        cat "$tmp/h200-now-ig-link.md"
        echo "## H200, the first build"
        echo
        echo "The scalar paged decode and WMMA flash prefill kernels, before issue 18's (calibration-h200-first-build.yaml), fitted on the cells of gpu-paradigms-batch16 the model describes:"
        echo
        echo '```text'
        grep -E "^(prefill|decode):" "$tmp/h200.log"
        sed -n 's/^left out of the fit: /left out: /p' "$tmp/h200.err"
        echo '```'
        echo
        cat "$tmp/h200-other.md"
        echo "Fitted on gpu-paradigms-batch16's full and h2o cells only, so the host link keeps the rate measured on the card (pinned copies, ceilings.json): the infinigen row is held out, the full and h2o rows are the fit's own cells."
        echo
        cat "$tmp/h200.md"
        echo "The same fit, the host link taken from the current engine's calibration (fitted on gpu-paradigms-batch32's InfiniGen cell, another experiment):"
        echo
        echo '```text'
        grep -E "^decode:" "$tmp/h200-held-out-link.log"
        echo '```'
        echo
        cat "$tmp/h200-link.md"
    } > docs/cost-validation.md
    # The README's summary table, each row's medians over the cells it names.
    python3 scripts/validation-table.py
    echo "docs/cost-validation.md, README.md (its table), results/baselines/cpu/calibration-cpu.yaml, results/baselines/h100/calibration-h100-sxm.yaml, results/baselines/h100/calibration-h100-sxm-first-build.yaml, results/baselines/h200/calibration-h200.yaml, results/baselines/h200/calibration-h200-first-build.yaml"
