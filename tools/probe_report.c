/* The probe's output: the readable table, the JSON object (every figure), and the verdict text
 * both share. Nothing here measures; everything reads a filled spw_probe_result. */
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "probe.h"

static const struct {
    const char *name, *label;
} path_names[SPW_PATH_COUNT_] = {
    [SPW_PATH_PINNED_H2D] = {"pinned_h2d", "pinned host -> device"},
    [SPW_PATH_PINNED_D2H] = {"pinned_d2h", "pinned device -> host"},
    [SPW_PATH_BOTH] = {"both_ways", "both ways, 2 streams (total)"},
    [SPW_PATH_PAGEABLE_H2D] = {"pageable_h2d", "pageable host -> device"},
    [SPW_PATH_PAGEABLE_D2H] = {"pageable_d2h", "pageable device -> host"},
    [SPW_PATH_D2D] = {"d2d", "device -> device (read+write)"},
};
static const char *const lat_names[SPW_LAT_COUNT_] = {"dev_alloc_small", "dev_alloc_large", "pinned_alloc"};

void spw_probe_result_init(spw_probe_result *r) {
    memset(r, 0, sizeof *r);
    for (int i = 0; i < SPW_PATH_COUNT_; i++) {
        r->paths[i].name = path_names[i].name;
        r->paths[i].label = path_names[i].label;
    }
    for (int i = 0; i < SPW_LAT_COUNT_; i++) r->lat[i].name = lat_names[i];
    r->ok = true;
}

void spw_probe_result_free(spw_probe_result *r) {
    free(r->chunks);
    r->chunks = NULL;
    r->nchunks = 0;
}

/* ---- shared helpers ---- */

static const char *sz(char *buf, size_t len, uint64_t bytes) {
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 4) v /= 1024.0, u++;
    if (u == 0 || v == floor(v))
        snprintf(buf, len, "%.0f %s", v, units[u]);
    else
        snprintf(buf, len, "%.2f %s", v, units[u]);
    return buf;
}

static const char *gb(char *buf, size_t len, double g) {
    if (!(g > 0))
        snprintf(buf, len, "-");
    else if (g >= 1000)
        snprintf(buf, len, "%.0f", g);
    else if (g >= 10)
        snprintf(buf, len, "%.1f", g);
    else
        snprintf(buf, len, "%.2f", g);
    return buf;
}

static const char *ver(char *buf, size_t len, int v) {
    if (v <= 0)
        snprintf(buf, len, "-");
    else
        snprintf(buf, len, "%d.%d", v / 1000, v % 1000 / 10);
    return buf;
}

static double eff(const spw_probe_path *p) {
    return p->ok && p->theoretical_gbps > 0 ? p->best_gbps / p->theoretical_gbps : 0;
}

static const char *latency_str(char *buf, size_t len, double us) {
    if (us >= 10000)
        snprintf(buf, len, "%.1f ms", us / 1000);
    else
        snprintf(buf, len, "%.0f us", us);
    return buf;
}

/* The first chunk flagged as system memory, or -1. */
static long first_flagged(const spw_probe_result *r) {
    for (size_t i = 0; i < r->nchunks; i++)
        if (r->chunks[i].v.cls == SPW_CHUNK_SYSMEM) return (long)i;
    return -1;
}

#define MAX_LINES 14
#define LINE 400
typedef char verdict_lines[MAX_LINES][LINE];

/* Append one line (truncated at LINE; dropped past MAX_LINES). */
static void add_line(verdict_lines out, int *n, const char *fmt, ...) SPW_PRINTF(3, 4);
static void add_line(verdict_lines out, int *n, const char *fmt, ...) {
    if (*n >= MAX_LINES) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out[(*n)++], LINE, fmt, ap);
    va_end(ap);
}

/* The plain-language verdict, one sentence a line. Returns the number of lines. */
static int verdict(const spw_probe_result *r, verdict_lines out) {
    int n = 0;
    char a[64], b[64], c[64], d[64];
    const spw_probe_path *P = r->paths;
#define ADD(...) add_line(out, &n, __VA_ARGS__)
    if (r->emulated)
        ADD("EMULATED: no real GPU was probed; every figure measures host memory copies through the emu backend, "
            "whose host<->device copies are throttled to %.2g GB/s (an emulated link).",
            SPW_PROBE_EMU_LINK_GBPS);

    long ff = first_flagged(r);
    if (!r->scan_ran || r->nchunks == 0) {
        ADD("Fallback scan measured no chunk: %s.", r->scan_error[0] ? r->scan_error : r->scan_stop);
    } else if (ff >= 0) {
        const spw_probe_chunk *ch = &r->chunks[ff];
        ADD("FALLBACK DETECTED: device memory beyond %s is backed by system memory (chunk %ld read at %s GB/s, "
            "%.3fx the VRAM reference %s GB/s); %zu of %zu chunks flagged.",
            sz(a, sizeof a, r->usable_bytes), ff, gb(b, sizeof b, ch->gbps), ch->v.ratio,
            gb(c, sizeof c, r->reference_gbps), r->flagged, r->nchunks);
        ADD("Usable device memory before fallback: %s.", sz(a, sizeof a, r->usable_bytes));
    } else {
        ADD("No fallback: all %zu chunks (%s, limit %s) read at VRAM speed (reference %s GB/s); usable device "
            "memory before fallback is at least %s.",
            r->nchunks, sz(a, sizeof a, r->scanned_bytes), r->max_mem_how, gb(b, sizeof b, r->reference_gbps),
            sz(c, sizeof c, r->usable_bytes));
    }

    /* A read copy moves each byte twice through VRAM, so healthy VRAM reads at 30-50% of the
     * theoretical bandwidth; under 10% even the first chunk is suspect. */
    if (!r->emulated && r->vram_theoretical_gbps > 0 && r->reference_gbps > 0 &&
        r->reference_gbps < 0.1 * r->vram_theoretical_gbps)
        ADD("Even the first chunk reads at only %s GB/s, %.1f%% of the VRAM's theoretical %.0f GB/s: device "
            "memory may be in system memory from the start, or the GPU is busy.",
            gb(a, sizeof a, r->reference_gbps), 100 * r->reference_gbps / r->vram_theoretical_gbps,
            r->vram_theoretical_gbps);

    if (r->selftest_passed)
        ADD("Detector self-test PASSED: a host-backed chunk (mapped pinned memory, %s) read at %s GB/s = %.3fx "
            "VRAM and was flagged as system memory.",
            sz(a, sizeof a, r->selftest_bytes), gb(b, sizeof b, r->selftest_gbps), r->selftest.ratio);
    else if (r->emulated)
        ADD("Detector self-test not conclusive on emu (%s GB/s = %.2fx): emulated device and host memory are "
            "the same RAM.",
            gb(b, sizeof b, r->selftest_gbps), r->selftest.ratio);
    else
        ADD("Detector self-test FAILED: the host-backed chunk was not flagged (%s); the fallback verdict "
            "cannot be trusted.",
            r->selftest_error[0] ? r->selftest_error : r->selftest.reason);

    const spw_probe_path *h = &P[SPW_PATH_PINNED_H2D], *dh = &P[SPW_PATH_PINNED_D2H], *bw = &P[SPW_PATH_BOTH];
    if (r->link.known) {
        ADD("Link: PCIe Gen%d x%d (%s; current Gen%d x%d) = %.1f GB/s per direction in theory. Pinned copies "
            "reach %s / %s GB/s (%.0f%% / %.0f%%), both ways %s GB/s (%.0f%% of %.1f).",
            r->link.max_gen, r->link.max_width, r->link.source, r->link.cur_gen, r->link.cur_width, r->link.gbps,
            gb(a, sizeof a, h->best_gbps), gb(b, sizeof b, dh->best_gbps), 100 * eff(h), 100 * eff(dh),
            gb(c, sizeof c, bw->best_gbps), 100 * eff(bw), 2 * r->link.gbps);
        if (r->link.cur_gen && r->link.max_gen && r->link.cur_gen < r->link.max_gen)
            ADD("The link reports Gen%d now but Gen%d at most: idle links train down (and virtual ones may report "
                "low); efficiency uses the maximum.",
                r->link.cur_gen, r->link.max_gen);
        if (h->ok && dh->ok && (eff(h) < 0.7 || eff(dh) < 0.7))
            ADD("Pinned copies run below 70%% of the link: check the slot's lanes, the NUMA node of the host "
                "memory, and other traffic on the link.");
    } else {
        ADD("Link: unknown (%s); pinned copies reach %s / %s GB/s, both ways %s GB/s.",
            r->emulated ? "emulated" : r->nvml_note[0] ? r->nvml_note : "no NVML, no sysfs entry",
            gb(a, sizeof a, h->best_gbps), gb(b, sizeof b, dh->best_gbps), gb(c, sizeof c, bw->best_gbps));
    }
    const spw_probe_path *ph = &P[SPW_PATH_PAGEABLE_H2D], *pd = &P[SPW_PATH_PAGEABLE_D2H];
    if (ph->ok && pd->ok && h->ok && (ph->best_gbps < 0.6 * h->best_gbps || pd->best_gbps < 0.6 * dh->best_gbps))
        ADD("Pageable copies reach only %s / %s GB/s: keep host copies in pinned memory (spillway's host pool "
            "does).",
            gb(a, sizeof a, ph->best_gbps), gb(b, sizeof b, pd->best_gbps));
    if (r->pin_ran && !r->pin_capped)
        ADD("PINNED MEMORY LIMITED: the system page-locks only %s of host memory%s. Host copies past it stay "
            "pageable: spillway.torch.offload warns and copies those weights from pageable memory, slower and "
            "blocking. Free host memory or raise the limit; offload less than that.",
            sz(a, sizeof a, r->pinnable_bytes), r->wsl2 ? " (WSL2 limits it)" : "");
    const spw_probe_latency *pl = &r->lat[SPW_LAT_PINNED];
    if (pl->ok && pl->median_us >= 1000) /* slow enough to matter on a hot path */
        ADD("%s of %s takes %s: pool pinned memory, never allocate it per buffer.", pl->api,
            sz(a, sizeof a, pl->bytes), latency_str(b, sizeof b, pl->median_us));

    if (r->recommended_budget) {
        spw_probe_size_arg(d, sizeof d, r->recommended_budget);
        ADD("Recommended budget (95%% of the usable memory, rounded down to 256 MiB): SPILLWAY_CONF=budget=%s  "
            "or  spillway run --budget %s -- CMD", d, d);
        if (r->wsl2 || ff >= 0)
            ADD("For a clear out-of-memory error at the budget instead of offloading: "
                "SPILLWAY_CONF=budget=%s,on_exhaust=fail",
                d);
    } else {
        ADD("No budget recommended: no VRAM chunk was measured.");
    }
    if (r->wsl2)
        ADD("WSL2: the Windows driver may back device allocations with shared system memory without any error; "
            "keep the budget at or below the usable figure.");
    if (!r->ok) ADD("PROBE FAILED: a validation, a CUDA call or the self-test failed (see FAILED above).");
#undef ADD
    return n;
}

/* ---- the table ---- */

static void print_chunk_runs(const spw_probe_result *r, FILE *f) {
    char a[64], b[64], c[64], d[64];
    size_t off = 0;
    fprintf(f, "  %-11s %-22s %-12s %-8s %s\n", "chunks", "offset", "GB/s", "x ref", "class");
    for (size_t i = 0; i < r->nchunks;) {
        /* consecutive chunks of one class (and all validated) print as one line */
        size_t j = i + 1;
        while (j < r->nchunks && r->chunks[j].v.cls == r->chunks[i].v.cls && r->chunks[j].validated == r->chunks[i].validated) j++;
        double lo = r->chunks[i].gbps, hi = lo, rlo = r->chunks[i].v.ratio, rhi = rlo;
        size_t bytes = 0;
        for (size_t k = i; k < j; k++) {
            const spw_probe_chunk *ch = &r->chunks[k];
            lo = fmin(lo, ch->gbps), hi = fmax(hi, ch->gbps);
            rlo = fmin(rlo, ch->v.ratio), rhi = fmax(rhi, ch->v.ratio);
            bytes += ch->bytes;
        }
        char idx[48], range[160], g[160], x[64];
        if (j - i == 1)
            snprintf(idx, sizeof idx, "%zu", i);
        else
            snprintf(idx, sizeof idx, "%zu-%zu", i, j - 1);
        snprintf(range, sizeof range, "%s +%s", sz(a, sizeof a, off), sz(b, sizeof b, bytes));
        if (j - i == 1)
            snprintf(g, sizeof g, "%s", gb(c, sizeof c, lo));
        else
            snprintf(g, sizeof g, "%s-%s", gb(c, sizeof c, lo), gb(d, sizeof d, hi));
        if (j - i == 1)
            snprintf(x, sizeof x, "%.2f", rlo);
        else
            snprintf(x, sizeof x, "%.2f-%.2f", rlo, rhi);
        fprintf(f, "  %-11s %-22s %-12s %-8s %s%s\n", idx, range, g, x, spw_chunk_class_name(r->chunks[i].v.cls),
                r->chunks[i].validated ? "" : "  VALIDATION FAILED");
        off += bytes;
        i = j;
    }
}

void spw_probe_print_table(const spw_probe_result *r, FILE *f) {
    char a[64], b[64], c[64];
    fprintf(f, "spillway probe %s: device %d, %s (%s backend)%s\n", spw_version(), r->device, r->name, r->backend,
            r->quick ? ", quick" : "");
    if (r->emulated)
        fprintf(f, "*** EMULATED: no real GPU. Every figure below is measured on host memory through the emu\n"
                   "*** backend (host<->device copies throttled to %.2g GB/s); it says nothing about a GPU. ***\n",
                SPW_PROBE_EMU_LINK_GBPS);
    if (r->backend_note[0]) fprintf(f, "(%s)\n", r->backend_note);

    fprintf(f, "\nDevice\n");
    fprintf(f, "  %-30s %s\n", "name", r->name);
    fprintf(f, "  %-30s %d.%d\n", "compute capability", r->cc_major, r->cc_minor);
    fprintf(f, "  %-30s %s / %s\n", "memory total / free", sz(a, sizeof a, r->total_bytes), sz(b, sizeof b, r->free_bytes));
    fprintf(f, "  %-30s %s / %s\n", "driver / runtime (CUDA)", ver(a, sizeof a, r->driver_version),
            ver(b, sizeof b, r->runtime_version));
    if (r->pci_bus_id[0]) fprintf(f, "  %-30s %s\n", "PCI bus id", r->pci_bus_id);
    fprintf(f, "  %-30s %s / %s\n", "managed: concurrent / pageable", r->concurrent_managed ? "yes" : "no",
            r->pageable_access ? "yes" : "no");
    fprintf(f, "  %-30s %s\n", "WSL2", r->wsl2 ? "yes" : "no");
    if (r->link.known)
        fprintf(f, "  %-30s current Gen%d x%d, max Gen%d x%d (%s) -> %.1f GB/s per direction\n", "PCIe link",
                r->link.cur_gen, r->link.cur_width, r->link.max_gen, r->link.max_width, r->link.source, r->link.gbps);
    else
        fprintf(f, "  %-30s unknown\n", "PCIe link");
    if (r->vram_theoretical_gbps > 0)
        fprintf(f, "  %-30s %.0f GB/s\n", "VRAM theoretical", r->vram_theoretical_gbps);
    fprintf(f, "  %-30s %s\n", "NVML", r->nvml_available ? (r->nvml_note[0] ? r->nvml_note : "yes") : r->nvml_note);
    if (r->procs_known) {
        if (r->nprocs == 0) fprintf(f, "  %-30s none\n", "processes using the GPU");
        for (int i = 0; i < r->nprocs; i++)
            fprintf(f, "  %-30s pid %u %s: %s\n", i ? "" : "processes using the GPU", r->procs[i].pid,
                    r->procs[i].name, r->procs[i].used_known ? sz(a, sizeof a, r->procs[i].used_bytes) : "memory not reported");
    }
    if (r->init_ms > 0) fprintf(f, "  %-30s %.0f ms\n", "context creation", r->init_ms);
    for (int i = 0; i < r->device_count && i < SPW_PROBE_MAX_DEVICES; i++)
        if (i != r->device)
            fprintf(f, "  %-30s %d: %s (%d.%d, %s)\n", "other device", i, r->devices[i].name, r->devices[i].cc_major,
                    r->devices[i].cc_minor, sz(a, sizeof a, r->devices[i].total_bytes));

    const spw_probe_path *p0 = &r->paths[0];
    fprintf(f, "\nTransfers (%s each, validated before timing; best of N, median beside it)\n", sz(a, sizeof a, p0->bytes));
    fprintf(f, "  %-32s %9s %9s %5s %10s  %s\n", "path", "GB/s", "median", "reps", "of limit", "limit GB/s");
    for (int i = 0; i < SPW_PATH_COUNT_; i++) {
        const spw_probe_path *p = &r->paths[i];
        if (!p->ran) continue;
        if (!p->ok) {
            fprintf(f, "  %-32s FAILED: %s\n", p->label, p->error[0] ? p->error : "unknown error");
            continue;
        }
        char e[32] = "-", t[32] = "-";
        if (p->theoretical_gbps > 0) {
            snprintf(e, sizeof e, "%.1f%%", 100 * eff(p));
            gb(t, sizeof t, p->theoretical_gbps);
        }
        fprintf(f, "  %-32s %9s %9s %5d %10s  %s\n", p->label, gb(a, sizeof a, p->best_gbps),
                gb(b, sizeof b, p->median_gbps), p->reps, e, t);
    }

    fprintf(f, "\nAllocation latency (allocate + free, median)\n");
    for (int i = 0; i < SPW_LAT_COUNT_; i++) {
        const spw_probe_latency *l = &r->lat[i];
        if (!l->ran) continue;
        char what[96];
        snprintf(what, sizeof what, "%s %s", l->api, sz(a, sizeof a, l->bytes));
        if (l->ok)
            fprintf(f, "  %-40s %12s  (min %s, %d reps)\n", what, latency_str(b, sizeof b, l->median_us),
                    latency_str(c, sizeof c, l->min_us), l->reps);
        else
            fprintf(f, "  %-40s FAILED: %s\n", what, l->error);
    }

    if (r->pin_ran) {
        fprintf(f, "\nPinned host memory (%s, %s at a time, all held together, up to %s)\n",
                r->lat[SPW_LAT_PINNED].api, sz(a, sizeof a, r->pin_chunk), sz(b, sizeof b, r->pin_cap));
        if (r->pin_capped)
            fprintf(f, "  %s held: none refused\n", sz(a, sizeof a, r->pinnable_bytes));
        else
            fprintf(f, "  %s held, the next refused: %s\n", sz(a, sizeof a, r->pinnable_bytes), r->pin_error);
    }
    fprintf(f, "\nFallback scan (device allocations of %s up to %s = %s; each chunk read into VRAM scratch,\n"
               "%d window(s) of %s, slowest window; flagged below %.2fx the reference)\n",
            sz(a, sizeof a, r->chunk_bytes), sz(b, sizeof b, r->max_mem), r->max_mem_how, r->windows_per_chunk,
            sz(c, sizeof c, r->window_bytes), SPW_DETECT_THRESHOLD);
    if (r->nchunks) print_chunk_runs(r, f);
    fprintf(f, "  scanned %s in %zu chunks; stopped: %s\n", sz(a, sizeof a, r->scanned_bytes), r->nchunks,
            r->scan_stop[0] ? r->scan_stop : "-");
    if (r->scan_error[0]) fprintf(f, "  FAILED: %s\n", r->scan_error);
    if (r->selftest_ran)
        fprintf(f, "  self-test (mapped pinned host memory, %s): %s GB/s, %.3fx reference -> %s: %s\n",
                sz(a, sizeof a, r->selftest_bytes), gb(b, sizeof b, r->selftest_gbps), r->selftest.ratio,
                spw_chunk_class_name(r->selftest.cls),
                r->selftest_passed ? "PASS" : r->emulated ? "not conclusive (emulated)" : "FAIL");
    if (r->selftest_error[0]) fprintf(f, "  self-test error: %s\n", r->selftest_error);

    verdict_lines lines;
    int n = verdict(r, lines);
    fprintf(f, "\nVerdict\n");
    for (int i = 0; i < n; i++) fprintf(f, "  - %s\n", lines[i]);
    fprintf(f, "\nprobe took %.1f s\n", r->elapsed_s);
}

/* ---- JSON ---- */

static void jstr(FILE *f, const char *s) {
    if (!s) {
        fputs("null", f);
        return;
    }
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p == '\n')
            fputs("\\n", f);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

static void jnum(FILE *f, double x) {
    if (isfinite(x))
        fprintf(f, "%.6g", x);
    else
        fputs("null", f);
}

static const char *jb(bool b) { return b ? "true" : "false"; }

/* "" becomes null, so a missing error is not a string to test for */
static void jerr(FILE *f, const char *s) { jstr(f, s && s[0] ? s : NULL); }

void spw_probe_print_json(const spw_probe_result *r, FILE *f) {
    fprintf(f, "{\"tool\":\"spillway probe\",\"version\":");
    jstr(f, spw_version());
    fprintf(f, ",\"backend\":");
    jstr(f, r->backend);
    fprintf(f, ",\"emulated\":%s,\"quick\":%s,\"backend_note\":", jb(r->emulated), jb(r->quick));
    jerr(f, r->backend_note);
    fprintf(f, ",\"ok\":%s,\"elapsed_s\":", jb(r->ok));
    jnum(f, r->elapsed_s);

    fprintf(f, ",\n\"device\":{\"index\":%d,\"name\":", r->device);
    jstr(f, r->name);
    fprintf(f, ",\"compute_capability\":\"%d.%d\",\"total_bytes\":%zu,\"free_bytes\":%zu,\"driver_version\":%d,"
               "\"runtime_version\":%d,\"concurrent_managed_access\":%s,\"pageable_memory_access\":%s,"
               "\"integrated\":%s,\"wsl2\":%s,\"pci_bus_id\":",
            r->cc_major, r->cc_minor, r->total_bytes, r->free_bytes, r->driver_version, r->runtime_version,
            jb(r->concurrent_managed), jb(r->pageable_access), jb(r->integrated), jb(r->wsl2));
    jerr(f, r->pci_bus_id);
    fprintf(f, ",\"vram_theoretical_gbps\":");
    jnum(f, r->vram_theoretical_gbps);
    fprintf(f, ",\"context_init_ms\":");
    jnum(f, r->init_ms);
    fprintf(f, "},\n\"devices\":[");
    for (int i = 0; i < r->device_count && i < SPW_PROBE_MAX_DEVICES; i++) {
        fprintf(f, "%s{\"index\":%d,\"name\":", i ? "," : "", i);
        jstr(f, r->devices[i].name);
        fprintf(f, ",\"compute_capability\":\"%d.%d\",\"total_bytes\":%zu}", r->devices[i].cc_major,
                r->devices[i].cc_minor, r->devices[i].total_bytes);
    }
    fprintf(f, "],\n\"nvml\":{\"available\":%s,\"match\":", jb(r->nvml_available));
    jstr(f, r->nvml_match);
    fprintf(f, ",\"note\":");
    jerr(f, r->nvml_note);
    fprintf(f, ",\"processes_known\":%s,\"processes\":[", jb(r->procs_known));
    for (int i = 0; i < r->nprocs; i++) {
        fprintf(f, "%s{\"pid\":%u,\"name\":", i ? "," : "", r->procs[i].pid);
        jstr(f, r->procs[i].name);
        if (r->procs[i].used_known)
            fprintf(f, ",\"used_bytes\":%llu}", (unsigned long long)r->procs[i].used_bytes);
        else
            fprintf(f, ",\"used_bytes\":null}");
    }
    fprintf(f, "]},\n\"link\":{\"known\":%s,\"source\":", jb(r->link.known));
    jstr(f, r->link.source);
    fprintf(f, ",\"current_gen\":%d,\"current_width\":%d,\"max_gen\":%d,\"max_width\":%d,"
               "\"theoretical_gbps_per_direction\":",
            r->link.cur_gen, r->link.cur_width, r->link.max_gen, r->link.max_width);
    jnum(f, r->link.gbps);
    fprintf(f, ",\"theoretical_gbps_both\":");
    jnum(f, 2 * r->link.gbps);

    fprintf(f, "},\n\"paths\":{");
    for (int i = 0; i < SPW_PATH_COUNT_; i++) {
        const spw_probe_path *p = &r->paths[i];
        fprintf(f, "%s\n  \"%s\":{\"label\":", i ? "," : "", p->name);
        jstr(f, p->label);
        fprintf(f, ",\"ran\":%s,\"ok\":%s,\"validated\":%s,\"bytes\":%zu,\"reps\":%d,\"statistic\":\"best\","
                   "\"gbps\":",
                jb(p->ran), jb(p->ok), jb(p->validated), p->bytes, p->reps);
        jnum(f, p->ok ? p->best_gbps : NAN);
        fprintf(f, ",\"median_gbps\":");
        jnum(f, p->ok ? p->median_gbps : NAN);
        fprintf(f, ",\"theoretical_gbps\":");
        jnum(f, p->theoretical_gbps > 0 ? p->theoretical_gbps : NAN);
        fprintf(f, ",\"efficiency\":");
        jnum(f, eff(p) > 0 ? eff(p) : NAN);
        fprintf(f, ",\"error\":");
        jerr(f, p->error);
        fputc('}', f);
    }
    fprintf(f, "},\n\"latency\":{");
    for (int i = 0; i < SPW_LAT_COUNT_; i++) {
        const spw_probe_latency *l = &r->lat[i];
        fprintf(f, "%s\n  \"%s\":{\"api\":", i ? "," : "", l->name);
        jstr(f, l->api);
        fprintf(f, ",\"ran\":%s,\"ok\":%s,\"bytes\":%zu,\"reps\":%d,\"statistic\":\"median\",\"median_us\":",
                jb(l->ran), jb(l->ok), l->bytes, l->reps);
        jnum(f, l->ok ? l->median_us : NAN);
        fprintf(f, ",\"min_us\":");
        jnum(f, l->ok ? l->min_us : NAN);
        fprintf(f, ",\"error\":");
        jerr(f, l->error);
        fputc('}', f);
    }
    fprintf(f, "},\n\"pinned_host\":{\"ran\":%s,\"chunk_bytes\":%zu,\"cap_bytes\":%zu,\"pinnable_bytes\":%zu,"
               "\"capped\":%s,\"error\":",
            jb(r->pin_ran), r->pin_chunk, r->pin_cap, r->pinnable_bytes, jb(r->pin_capped));
    jerr(f, r->pin_error);
    fprintf(f, "},\n\"fallback\":{\"ran\":%s,\"ok\":%s,\"max_mem_bytes\":%zu,\"max_mem_how\":", jb(r->scan_ran),
            jb(r->scan_ok), r->max_mem);
    jstr(f, r->max_mem_how);
    fprintf(f, ",\"chunk_bytes\":%zu,\"window_bytes\":%zu,\"windows_per_chunk\":%d,\"threshold\":", r->chunk_bytes,
            r->window_bytes, r->windows_per_chunk);
    jnum(f, SPW_DETECT_THRESHOLD);
    fprintf(f, ",\"reference_gbps\":");
    jnum(f, r->reference_gbps);
    fprintf(f, ",\"scanned_bytes\":%zu,\"chunk_count\":%zu,\"flagged\":%zu,\"fallback_detected\":%s,"
               "\"usable_before_fallback_bytes\":%zu,\"stop\":",
            r->scanned_bytes, r->nchunks, r->flagged, jb(r->fallback_detected), r->usable_bytes);
    jstr(f, r->scan_stop);
    fprintf(f, ",\"error\":");
    jerr(f, r->scan_error);
    fprintf(f, ",\"chunks\":[");
    size_t off = 0;
    for (size_t i = 0; i < r->nchunks; i++) {
        const spw_probe_chunk *ch = &r->chunks[i];
        fprintf(f, "%s\n  {\"index\":%zu,\"offset_bytes\":%zu,\"bytes\":%zu,\"gbps\":", i ? "," : "", i, off, ch->bytes);
        jnum(f, ch->gbps);
        fprintf(f, ",\"ratio\":");
        jnum(f, ch->v.ratio);
        fprintf(f, ",\"class\":\"%s\",\"validated\":%s,\"remeasured\":%d,\"reason\":", spw_chunk_class_name(ch->v.cls),
                jb(ch->validated), ch->remeasured);
        jstr(f, ch->v.reason);
        fputc('}', f);
        off += ch->bytes;
    }
    fprintf(f, "]},\n\"self_test\":{\"ran\":%s,\"passed\":%s,\"required\":%s,\"bytes\":%zu,\"gbps\":",
            jb(r->selftest_ran), jb(r->selftest_passed), jb(!r->emulated), r->selftest_bytes);
    jnum(f, r->selftest_gbps);
    fprintf(f, ",\"ratio\":");
    jnum(f, r->selftest.ratio);
    fprintf(f, ",\"class\":\"%s\",\"reason\":", spw_chunk_class_name(r->selftest.cls));
    jstr(f, r->selftest.reason);
    fprintf(f, ",\"error\":");
    jerr(f, r->selftest_error);

    char d[64];
    spw_probe_size_arg(d, sizeof d, r->recommended_budget);
    fprintf(f, "},\n\"verdict\":{\"usable_before_fallback_bytes\":%zu,\"fallback_detected\":%s,"
               "\"link_efficiency_h2d\":",
            r->usable_bytes, jb(r->fallback_detected));
    jnum(f, eff(&r->paths[SPW_PATH_PINNED_H2D]) > 0 ? eff(&r->paths[SPW_PATH_PINNED_H2D]) : NAN);
    fprintf(f, ",\"link_efficiency_d2h\":");
    jnum(f, eff(&r->paths[SPW_PATH_PINNED_D2H]) > 0 ? eff(&r->paths[SPW_PATH_PINNED_D2H]) : NAN);
    fprintf(f, ",\"recommended_budget_bytes\":%zu,\"recommended_budget\":", r->recommended_budget);
    if (r->recommended_budget) {
        char conf[96], run[128];
        snprintf(conf, sizeof conf, "SPILLWAY_CONF=budget=%s", d);
        snprintf(run, sizeof run, "spillway run --budget %s -- CMD", d);
        jstr(f, d);
        fprintf(f, ",\"conf\":");
        jstr(f, conf);
        fprintf(f, ",\"run\":");
        jstr(f, run);
    } else {
        fprintf(f, "null,\"conf\":null,\"run\":null");
    }
    fprintf(f, ",\"summary\":[");
    verdict_lines lines;
    int n = verdict(r, lines);
    for (int i = 0; i < n; i++) {
        fprintf(f, "%s\n  ", i ? "," : "");
        jstr(f, lines[i]);
    }
    fprintf(f, "]}}\n");
}
