/* Host facts for the probe: WSL2, available memory, the PCIe link from sysfs (when NVML is
 * missing), process names. */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "probe.h"

/* Read the first line of a small file into buf (newline stripped); false if unreadable. */
static bool read_line(const char *path, char *buf, size_t len) {
    FILE *f = fopen(path, "r");
    if (!f) return false;
    bool ok = fgets(buf, (int)len, f) != NULL;
    fclose(f);
    if (ok) buf[strcspn(buf, "\n")] = '\0';
    return ok;
}

bool spw_probe_is_wsl2(void) {
    /* WSL2 exposes the GPU through /dev/dxg (the DirectX kernel interface); its kernel says
     * "microsoft" / "WSL" in its version string. Either is enough. */
    if (access("/dev/dxg", F_OK) == 0) return true;
    char v[512];
    if (!read_line("/proc/version", v, sizeof v)) return false;
    return strstr(v, "microsoft") || strstr(v, "Microsoft") || strstr(v, "WSL");
}

size_t spw_probe_host_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kib = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
    fclose(f);
    return (size_t)kib * 1024;
}

bool spw_probe_sysfs_link(const char *bus_id, spw_probe_link *out) {
    if (!bus_id || !bus_id[0]) return false;
    char id[32], path[128], cs[64], cw[64], ms[64], mw[64];
    size_t n = strlen(bus_id);
    if (n >= sizeof id) return false;
    for (size_t i = 0; i <= n; i++) id[i] = (char)tolower((unsigned char)bus_id[i]);
#define RD(file, buf) (snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/" file, id), read_line(path, buf, sizeof buf))
    bool okc = RD("current_link_speed", cs) && RD("current_link_width", cw);
    bool okm = RD("max_link_speed", ms) && RD("max_link_width", mw);
#undef RD
    if (!okc && !okm) return false;
    spw_probe_link l = {.source = "sysfs"};
    if (okc) l.cur_gen = spw_probe_gen_from_sysfs(cs), l.cur_width = atoi(cw);
    if (okm) l.max_gen = spw_probe_gen_from_sysfs(ms), l.max_width = atoi(mw);
    l.gbps = spw_probe_link_gbps(l.max_gen, l.max_width);
    if (l.gbps <= 0) l.gbps = spw_probe_link_gbps(l.cur_gen, l.cur_width);
    l.known = l.gbps > 0;
    if (!l.known) return false;
    *out = l;
    return true;
}

void spw_probe_proc_name(unsigned pid, char *buf, size_t len) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%u/comm", pid);
    if (!read_line(path, buf, len) || !buf[0]) snprintf(buf, len, "?");
}
