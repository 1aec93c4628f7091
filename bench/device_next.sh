#!/usr/bin/env bash
# The device runs left for the next session, one device-tool call each, from the repository
# root, carry `.whl` (rebuilt from HEAD first: see bench/device_setup.sh).
# Session 12 ran attribution and the live diagnostics (bench/NOTES-agent.md, session 12);
# session 11 ran ilpin, dfactors, kernels and eager; merge repeats with
# bench/ab_merge.py. Sequential twins cannot judge the eager targets on this machine (vCPU speeds
# drift apart by 15-50%); twins interleaved on one CPU can. What each does:
#   bash bench/device_next.sh ilpin        # the issue's summary: eager, decode_graph, graph_tiny
#                                          # interleaved on CPU 5, null + default (~7 min)
#   bash bench/device_next.sh dfactors     # the eager decode step's per-window cost, interleaved
#                                          # on CPU 5: default, no_release, kernels_only, no_api
#                                          # (~5 min); read switch_us_per_window in the output
#   bash bench/device_next.sh first        # deager then pc in one call (~8 min, under 600 s)
#   bash bench/device_next.sh tiny         # tiny-kernel graph A/B, twice: the CUPTI-free graph
#                                          # probe (replaywatch.py) after detach (~4 min; ran in
#                                          # session 9: agent-ab-h200-s9-tiny-watch.json)
#   bash bench/device_next.sh deager       # the demo's decode step launched eagerly: twin A/B,
#                                          # null/default/no_release (CUPTI kept between
#                                          # windows: what the releases cost) (~4 min)
#   bash bench/device_next.sh pc           # PC ranges spaced to 5%: twin A/B, eager (~4 min)
#   bash bench/device_next.sh probe        # graph_tiny: the graph probe's linger, repeated (~7 min)
#   bash bench/device_next.sh kernels      # every kernel gate at the new defaults + the bench (~5 min)
#   bash bench/device_next.sh fp8          # fp8 decode variants against bf16 (~3 min)
#   bash bench/device_next.sh prefill      # prefill variants against SDPA flash/cuDNN (~2 min)
#   bash bench/device_next.sh eager        # eager target, interleaved twins: null/default x3 (~6 min)
#   bash bench/device_next.sh attribution  # PC samples vs GPU time on a steady decode step (~2 min)
#   bash bench/device_next.sh pcsync       # the torch.compile block's PC ranges without the
#                                          # drains (KDASH_AGENT_PC_SYNC=0) then with, same-process
#                                          # cost and attribution each (~4 min; not yet run)
#   bash bench/device_next.sh livediag     # live attach + PC sampling on torch.compile in tmux,
#                                          # twice, stacks at 20 s (~2 min; session 12: no hang)
#   bash bench/device_next.sh timeline     # every decode program stamped, split scans (~1 min)
#   bash bench/device_next.sh kvstream     # the KV cache read with loads only (~2 min)
#   bash bench/device_next.sh prefillncu   # Nsight Compute on prefill and cuDNN at D=128 (~1 min)
set -uo pipefail
bash bench/device_setup.sh >/dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
case "${1:-}" in
first)
    T_DEAGER=280 bash "$0" deager
    T_PC=250 bash "$0" pc ;;
deager)
    cd bench && timeout "${T_DEAGER:-330}" python3 -u gpu_ab_cost.py --targets decode_eager \
        --variants null,default,no_release --name agent-ab-h200-decode-eager.json \
        2>&1 | grep -E "^decode_eager|failed|Error" | cut -c1-700 ;;
pc)
    cd bench && timeout "${T_PC:-300}" python3 -u gpu_ab_cost.py --targets eager --attach-s 20 \
        --variants pc_sampling,pc_sampling#2 --name agent-ab-h200-pc-spaced.json \
        2>&1 | grep -E "^eager|failed|Error" | cut -c1-700 ;;
ilpin)
    cd bench && timeout 570 python3 -u gpu_ab_cost.py --targets eager,decode_graph,graph_tiny \
        --interleaved 1 --pin 5 --variants null,default --name agent-ab-h200.json \
        2>&1 | grep -E "^(eager|decode_graph|graph_tiny)/|failed|Error" | cut -c1-600 ;;
pcsync)
    cd bench
    for sync in 0 1; do
        KDASH_AGENT_PC_SYNC=$sync PCS_TARGET=compile timeout 150 python3 -u gpu_pcs_agent.py \
            >/dev/null 2>&1
        cp "$OUT/pcs-attribution-h200-compile.json" "$OUT/pcs-attribution-h200-compile-sync$sync.json"
        cp "$OUT/pcs-agent-h200.json" "$OUT/pcs-agent-h200-compile-sync$sync.json"
        SYNC=$sync python3 - <<'PY'
import json, os
out = os.environ["OUT"]
a = json.load(open(out + "/pcs-agent-h200.json"))
d = json.load(open(out + "/pcs-attribution-h200-compile.json"))
edges = [(r.get("sync_ms"), r.get("start_ms"), r.get("began_on")) for r in d["ranges"]][:4]
print("sync=" + os.environ["SYNC"], a.get("pc_on_vs_off_pct"), d["summary"], edges)
PY
    done ;;
livediag)
    DIAG_VARIANTS=on,on timeout 260 python3 -u bench/gpu_pcs_live_diag.py 2>&1 | tail -24 ;;
dfactors)
    cd bench && timeout 570 python3 -u gpu_ab_cost.py --targets decode_eager --interleaved 1 \
        --pin 5 --variants default,no_release,kernels_only,no_api,null \
        --name agent-ab-h200-decode-eager-factors.json \
        2>&1 | grep -E "^decode_eager/|failed|Error" | cut -c1-600 ;;
probe)
    cd bench && timeout 450 python3 -u gpu_ab_cost.py --screen graph_probe \
        2>&1 | grep -E "^(import_only|probe_fin|agent)|failed|Error" | cut -c1-500 ;;
kernels)
    DEFAULTS=1 timeout 560 bash bench/device_kernels.sh 2>&1 | tail -40 | cut -c1-400 ;;
attribution)
    cd bench && PCS_STEADY=1 timeout 200 python3 -u gpu_pcs_agent.py 2>&1 | tail -2 | cut -c1-1500
    python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "pcs-attribution-h200-steady.json")
if os.path.exists(p):
    d = json.load(open(p))
    print("attribution", d["summary"])
    for r in d["attribution"].get("ranges", [])[:12]:
        print(" ", r["max_gap_points"], r["max_gap_points_coverage"],
              [(k["kernel"][:24], k["gpu_time_share"], k["coverage_share"], k["sample_share"])
               for k in r["kernels"]])
PY
    ;;
tiny)
    cd bench
    timeout "${T_TINY:-330}" python3 -u gpu_ab_cost.py --targets graph_tiny --variants null,default,default#2 \
        --name agent-ab-h200-tiny-watch.json 2>&1 | grep -E "^graph_tiny|failed|Error" | cut -c1-700
    grep -o "kdash never started CUPTI in it" "$OUT/agent-ab-h200-tiny-watch.json" | sort | uniq -c ;;
eager)
    cd bench && timeout 480 python3 -u gpu_ab_cost.py --targets eager --interleaved 3 --pin 5 \
        --variants null,default --name agent-ab-h200-eager-il3.json \
        2>&1 | grep -E "^eager|failed|Error" | cut -c1-700 ;;
prefill)
    timeout 580 bash bench/device_prefill.sh 2>&1 | tail -40 | cut -c1-400 ;;
fp8)
    timeout 580 bash bench/device_fp8.sh 2>&1 | tail -40 | cut -c1-400 ;;
timeline)
    cd bench && timeout 300 python3 -u gpu_decode_timeline.py 2>&1 | grep -v Warn | cut -c1-700 ;;
kvstream)
    cd bench && timeout 300 python3 -u gpu_kv_stream.py 2>&1 | grep -v Warn | tail -60 | cut -c1-300 ;;
prefillncu)
    timeout 500 bash bench/device_prefill_ncu.sh 2>&1 | tail -60 | cut -c1-200 ;;
*) echo "usage: bash bench/device_next.sh ilpin|dfactors|first|tiny|deager|pc|probe|kernels|fp8|prefill|eager|attribution|pcsync|livediag|timeline|kvstream|prefillncu"; exit 2 ;;
esac
