"""The agent's numbers and names: protocol version, environment variables, bounds, timings,
the duty cycle's defaults and the CUPTI activity kinds. Standard library only, like every
module the agent loads into the target (see server.py)."""

from __future__ import annotations

AGENT_VERSION = 2  # 2: duty cycle (START period_ms/on_ms/continuous, SET), "activity on" rows
ENV_FLAG = "KDASH_AGENT"
ENV_FAKE_CUDA = "KDASH_AGENT_FAKE_CUDA"
# "0" in the target's environment: CUPTI stays initialised between duty-cycle windows (the
# A/B bench's factor for what the releases themselves cost; bench/gpu_ab_cost.py no_release)
ENV_RELEASE = "KDASH_AGENT_RELEASE"
# "0" in the target's environment: no CUPTI refresh before a session's first PC range (what
# the refresh changes, bench/gpu_pcs_agent.py)
ENV_PC_FIRST_REFRESH = "KDASH_AGENT_PC_FIRST_REFRESH"
# a comma-separated activity list in the target's environment: what a START that names none
# switches on instead of DEFAULT_ACTIVITIES (the A/B bench's factors, e.g. `kernels` alone)
ENV_ACTIVITIES = "KDASH_AGENT_ACTIVITIES"

POLL_S = 0.05  # how often the session looks at its socket and queue
FLUSH_EVERY_S = 0.2  # how often completed CUPTI buffers are asked for
OFFSET_EVERY_S = 10.0
MAX_PENDING_ROWS = 2_000_000  # agent-side queue bound; rows beyond it are counted as dropped
BUFFER_BYTES = 4 * 1024 * 1024
SEND_TIMEOUT_S = 5.0  # a client that reads nothing for this long is treated as gone
# Bounds on what a peer of our own user can make the agent hold: connections that
# wait for the session, the first frame's size, and per-session state (server.Agent).
SPEAK_WAIT_S = 5.0  # a connection that sends no request within this is closed
ADMIT_WAIT_S = 1.0  # how long a request waits for the previous session's teardown, then "busy"
LISTEN_BACKLOG = 64
MAX_PENDING_CONNS = 16  # accepted connections waiting to speak (or for a teardown), at most
MAX_CLIENT_PAYLOAD = 64 * 1024  # a client request (START, SET, STATS, STOP) is ~300 bytes
MAX_ACTIVITIES = 32  # names in a START's activities list
MAX_NOTES = 16  # STATUS/STATS notes kept; each cut to MAX_NOTE_CHARS
MAX_NOTE_CHARS = 400
# the session's string dictionary (kernel, API, NVTX names sent to the client)
MAX_SESSION_NAMES = 500_000
MAX_SESSION_NAME_BYTES = 128 * 1024 * 1024
MAX_NAME_CHARS = 16 * 1024
DETACH_WAIT_S = 1.0  # how long a detach waits for the target's next CUDA call (detach.py)
GRAPH_PROBE_S = 1.0  # how long START listens for CUDA-graph launches before enabling kernels

# Duty cycle: CUPTI activity on for ON_MS of every PERIOD_MS by default, because
# continuous activity cost the H200 target 12.7% (eager) and 59% (CUDA-graph replays of tiny
# kernels), far above the 2% floor. A client asks for other values, or continuous, in START or SET.
DUTY_PERIOD_MS = 1000
DUTY_ON_MS = 100
MIN_ON_MS = 10  # below this the enable/flush/disable work of a window outweighs what it records
MAX_PERIOD_MS = 60_000
WINDOW_NAME = "activity on"  # markers rows (domain WINDOW_DOMAIN) that bound every on-window
WINDOW_DOMAIN = "kdash"
PC_WINDOW_NAME = "pc sampling"  # markers rows bounding every PC-sampling range

# PC sampling: off until a client asks (START/SET "pc_sampling": true); then a range
# of PC_ON_MS every PC_PERIOD_MS, run by its own thread while kernel activity is off (CUPTI
# refuses both at once), its CUPTI calls made with the GIL held (pcsampling.SamplingRanges says
# why).
PC_ON_MS = 200
PC_PERIOD_MS = 2000
PC_MIN_ON_MS, PC_MAX_ON_MS = 20, 2000
ENV_FAKE_PCSAMPLING = "KDASH_AGENT_FAKE_PCSAMPLING"  # test seam: a stand-in libcupti+libcuda

# CUPTI's CUpti_ActivityFlag marker bits (cupti-python 13.0 lists START but not END by name).
MARKER_INSTANT = 1 << 0
MARKER_START = 1 << 1
MARKER_END = 1 << 2
MAX_OPEN_MARKERS = 100_000

DEFAULT_ACTIVITIES = (
    "kernels",
    "memcpy",
    "memset",
    "runtime",
    "driver",
    "synchronization",
    "markers",
)
# activity name -> cupti.ActivityKind member name
ACTIVITY_KINDS = {
    "kernels": "CONCURRENT_KERNEL",
    "memcpy": "MEMCPY",
    "memset": "MEMSET",
    "runtime": "RUNTIME",
    "driver": "DRIVER",
    "synchronization": "SYNCHRONIZATION",
    "markers": "MARKER",
}
REQUIRED_ACTIVITY = "kernels"  # without it there is nothing to show: unavailable
# API records kept (by cupti_runtime_cbid.h / cupti_driver_cbid.h name): launches, waits, copies
API_KEEP = r"Launch|Synchroniz|Memcpy|Memset|StreamWaitEvent|EventRecord"
