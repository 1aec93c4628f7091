#include <stdint.h>
#include <string.h>
#include <stddef.h>
#include <stdlib.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>
#include <pthread.h>
typedef void (*req_t)(uint8_t **buffer, size_t *size, size_t *max_records);
typedef void (*done_t)(void *ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid);
static req_t g_req; static done_t g_done;
static const char *names[3] = {"raw_gemm_0", "raw_gemm_1", "raw_gemm_2"};
static const char *mname = "raw_range", *mdomain = "rawdomain";
int cuptiActivityRegisterCallbacks(req_t r, done_t d) { g_req = r; g_done = d; return 0; }
/* The callback API of detach.py: one subscriber; a "target thread" makes its next call 30 ms
   after a callback is enabled: a graph launch (id 311) when FAKE_CUPTI_GRAPHS is set and that
   id is enabled, else a kernel launch (211) if enabled. Events go to FAKE_CUPTI_LOG. */
typedef void (*cb_t)(void *ud, int domain, uint32_t cbid, const void *data);
static cb_t g_cb; static int g_sub, g_en211, g_en311, g_firing;
static void logline(const char *what) {
    const char *p = getenv("FAKE_CUPTI_LOG"); struct timespec t; FILE *f;
    if (!p || !(f = fopen(p, "a"))) return;
    clock_gettime(CLOCK_MONOTONIC, &t);
    fprintf(f, "%.6f %s\n", t.tv_sec + t.tv_nsec / 1e9, what); fclose(f);
}
int cuptiSubscribe(void **sub, cb_t cb, void *ud) {
    if (g_cb) return 39; /* MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED */
    g_cb = cb; g_en211 = g_en311 = 0; *sub = &g_sub; logline("subscribe"); return 0;
}
int cuptiUnsubscribe(void *sub) { g_cb = 0; logline("unsubscribe"); return 0; }
int cuptiFinalize(void) { logline("cupti finalize"); return 0; }
static void *fire(void *arg) {
    int site_enter = 0, site_exit = 1; cb_t c; uint32_t id = 0;
    usleep(30000);
    c = g_cb;
    if (getenv("FAKE_CUPTI_GRAPHS") && g_en311) id = 311; else if (g_en211) id = 211;
    if (c && id) { c(0, 2, id, &site_enter); c(0, 2, id, &site_exit); }
    g_firing = 0; return 0;
}
int cuptiEnableCallback(uint32_t en, void *sub, int domain, uint32_t cbid) {
    pthread_t t;
    if (cbid == 211) g_en211 = en; if (cbid == 311) g_en311 = en;
    if (en && !g_firing) { g_firing = 1; pthread_create(&t, 0, fire, 0); pthread_detach(t); }
    return 0;
}
int fake_registered(void) { return g_req != 0; }
void fake_clear(void) { g_req = 0; g_done = 0; }
static void p16(uint8_t *p, size_t o, uint16_t v) { memcpy(p + o, &v, 2); }
static void p32(uint8_t *p, size_t o, uint32_t v) { memcpy(p + o, &v, 4); }
static void p64(uint8_t *p, size_t o, uint64_t v) { memcpy(p + o, &v, 8); }
int fake_emit(int n, uint64_t now, int with_api, uint32_t marker_id, int bad) {
    uint8_t *buf = 0; size_t size = 0, maxn = 0, off = 0;
    g_req(&buf, &size, &maxn);
    if (!buf || size < 1024) return -1;
    for (int i = 0; i < n; i++) {
        if (with_api && off + 40 + 216 + 112 <= size) {
            uint8_t *a = buf + off; memset(a, 0, 40);
            p32(a, 0, 5); p32(a, 4, 7); p64(a, 8, now - 5000); p64(a, 16, now - 4000);
            p32(a, 24, 4242); p32(a, 28, 1234); p32(a, 32, i + 1); off += 40;
        }
        if (off + 216 + 112 > size) break;
        uint8_t *k = buf + off; memset(k, 0, 216);
        p32(k, 0, (bad == 1 && i == 0) ? 999 : 10); p16(k, 6, 64);
        p64(k, 16, now - 3000 + i);
        p64(k, 24, (bad == 2 && i % 50 == 49) ? 0 : now - 1000 + i); p32(k, 48, 7);
        p32(k, 52, 128); p32(k, 56, 1); p32(k, 60, 1); p32(k, 64, 256); p32(k, 68, 1);
        p32(k, 72, 1); p32(k, 76, 1024); p32(k, 80, 49152); p32(k, 92, i + 1);
        p64(k, 104, (uint64_t)(uintptr_t)names[i % 3]);
        p32(k, 156, (i % 2 && getenv("FAKE_CUPTI_GRAPHS")) ? 5 : 0);
        off += 216;
    }
    if (marker_id) {
        uint8_t *m = buf + off; memset(m, 0, 112);
        p32(m, 0, 12); p32(m, 4, 2); p64(m, 8, now - 950); p32(m, 16, marker_id);
        p32(m, 20, 2); p32(m, 28, 99);
        p64(m, 40, (uint64_t)(uintptr_t)mname); p64(m, 48, (uint64_t)(uintptr_t)mdomain);
        m += 56; p32(m, 0, 12); p32(m, 4, 4); p64(m, 8, now - 50); p32(m, 16, marker_id);
        off += 112;
    }
    g_done(0, 0, buf, size, off);
    return (int)off;
}
