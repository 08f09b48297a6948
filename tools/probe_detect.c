/* The probe's pure logic: the fallback classifier, PCIe arithmetic, budget rounding. No device
 * and no I/O here, so the tests drive it with synthetic series. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "probe.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double spw_probe_median(const double *v, size_t n) {
    if (n == 0) return 0;
    double small[16];
    double *tmp = n <= 16 ? small : malloc(n * sizeof *tmp);
    if (!tmp) return v[0]; /* out of memory: an approximation beats failing a report */
    memcpy(tmp, v, n * sizeof *tmp);
    qsort(tmp, n, sizeof *tmp, cmp_double);
    double m = n % 2 ? tmp[n / 2] : 0.5 * (tmp[n / 2 - 1] + tmp[n / 2]);
    if (tmp != small) free(tmp);
    return m;
}

static bool valid_bw(double x) { return isfinite(x) && x > 0; }

const char *spw_chunk_class_name(spw_chunk_class c) {
    switch (c) {
    case SPW_CHUNK_VRAM: return "vram";
    case SPW_CHUNK_SYSMEM: return "sysmem";
    case SPW_CHUNK_INVALID: break;
    }
    return "invalid";
}

double spw_probe_classify(const double *gbps, size_t n, double threshold, spw_chunk_verdict *out) {
    if (!(threshold > 0 && threshold < 1)) threshold = SPW_DETECT_THRESHOLD;
    size_t first = 0;
    while (first < n && !valid_bw(gbps[first])) first++;

    /* Reference: median of the consecutive leading valid chunks that are not themselves far
     * below the first valid one. A cliff right after chunk 0 stops the run at once (reference =
     * chunk 0); a noisy chunk among VRAM ones only shifts the median a little. */
    double ref = 0;
    if (first < n) {
        double lead[SPW_DETECT_REF_MAX];
        size_t k = 0;
        for (size_t i = first; i < n && k < SPW_DETECT_REF_MAX; i++) {
            if (!valid_bw(gbps[i]) || gbps[i] < threshold * gbps[first]) break;
            lead[k++] = gbps[i];
        }
        ref = spw_probe_median(lead, k);
    }

    for (size_t i = 0; i < n; i++) {
        spw_chunk_verdict *v = &out[i];
        if (!valid_bw(gbps[i]) || ref <= 0) {
            v->cls = SPW_CHUNK_INVALID;
            v->ratio = 0;
            snprintf(v->reason, sizeof v->reason, "%s",
                     ref <= 0 ? "no valid measurement in the series" : "not measured");
            continue;
        }
        v->ratio = gbps[i] / ref;
        if (v->ratio < threshold) {
            v->cls = SPW_CHUNK_SYSMEM;
            snprintf(v->reason, sizeof v->reason,
                     "%.4g GB/s is %.3fx the VRAM reference %.4g GB/s (below %.2fx): backed by system memory",
                     gbps[i], v->ratio, ref, threshold);
        } else {
            v->cls = SPW_CHUNK_VRAM;
            snprintf(v->reason, sizeof v->reason, "%.4g GB/s is %.2fx the VRAM reference %.4g GB/s",
                     gbps[i], v->ratio, ref);
        }
    }
    return ref;
}

double spw_probe_link_gbps(int gen, int width) {
    static const double gts[] = {0, 2.5, 5, 8, 16, 32, 64};
    if (gen < 1 || gen > 6 || width <= 0) return 0;
    double enc = gen <= 2 ? 8.0 / 10.0 : 128.0 / 130.0;
    return gts[gen] * enc / 8.0 * width;
}

int spw_probe_gen_from_gts(double gts) {
    static const double rate[] = {2.5, 5, 8, 16, 32, 64};
    for (int i = 0; i < 6; i++)
        if (fabs(gts - rate[i]) < 0.25) return i + 1;
    return 0;
}

int spw_probe_gen_from_sysfs(const char *text) {
    if (!text) return 0;
    char *end = NULL;
    double v = strtod(text, &end);
    if (end == text || !(v > 0)) return 0;
    while (*end == ' ') end++;
    if (strncmp(end, "GT/s", 4) != 0) return 0;
    return spw_probe_gen_from_gts(v);
}

size_t spw_probe_recommend_budget(size_t usable) {
    /* 95% leaves room for the driver's own allocations and fragmentation in the user's process. */
    double b = (double)usable * 0.95;
    size_t r = (size_t)b;
    return SPW_ALIGN_DOWN(r, 256 * SPW_MiB);
}

const char *spw_probe_size_arg(char *buf, size_t len, size_t bytes) {
    if (bytes && bytes % SPW_GiB == 0)
        snprintf(buf, len, "%zuGiB", bytes / SPW_GiB);
    else if (bytes && bytes % SPW_MiB == 0)
        snprintf(buf, len, "%zuMiB", bytes / SPW_MiB);
    else
        snprintf(buf, len, "%zu", bytes);
    return buf;
}
