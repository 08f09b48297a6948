/* A fake libnvidia-ml.so.1: two 80 GiB devices with nothing used, PCI bus ids that the fake
 * libcuda maps to ordinals 0 and 1. */
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

static char devs[2];
#define TOTAL (80ull << 30)

static int index_of(nvmlDevice_t d) {
    for (int i = 0; i < 2; i++)
        if ((char *)d == &devs[i]) return i;
    return -1;
}

EXPORT int nvmlInit_v2(void) { return 0; }
EXPORT int nvmlShutdown(void) { return 0; }
EXPORT int nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    if (i > 1) return 2;
    *d = (nvmlDevice_t)&devs[i];
    return 0;
}
EXPORT int nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *i) {
    int k = index_of(d);
    if (k < 0) return 2;
    *i = (unsigned)k;
    return 0;
}
EXPORT int nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *p) {
    int k = index_of(d);
    if (k < 0) return 2;
    memset(p, 0, sizeof *p);
    strcpy(p->busId, k == 0 ? "00000000:01:00.0" : "00000000:02:00.0");
    return 0;
}
EXPORT int nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    if (index_of(d) < 0) return 2;
    m->total = TOTAL;
    m->free = TOTAL - (512ull << 20);
    m->used = 512ull << 20;
    return 0;
}
EXPORT int nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    if (index_of(d) < 0) return 2;
    m->total = TOTAL;
    m->reserved = 256ull << 20;
    m->free = TOTAL - (512ull << 20);
    m->used = 256ull << 20;
    return 0;
}
