/* Backend-independent pieces of the seam: call names, and the cuda stubs of a build without CUDA. */
#include "backend.h"
#include "internal.h"

static const char *const call_names[SPW_CALL_COUNT_] = {
#define SPW_CALL_NAME_(id, name) [SPW_CALL_##id] = name,
    SPW_BACKEND_CALLS(SPW_CALL_NAME_)
#undef SPW_CALL_NAME_
};

/* Static name of a call kind ("dev_alloc"); "unknown" for values outside the enum. */
const char *spw__call_name(spw_call call) {
    if ((unsigned)call >= SPW_CALL_COUNT_) return "unknown";
    return call_names[call];
}

spw_status spw__backend_order_after(spw_backend *b, spw_stream s, spw_event e) {
    spw_status st = b->ops->stream_wait(b, s, e);
    return st ? b->ops->event_sync(b, e) : SPW_OK;
}

#ifndef SPW_HAVE_CUDA
/* Without the CUDA toolkit there is no cuda backend: creating one fails like a machine without a
 * device, so `auto` falls back to emu and `backend=cuda` gets a message saying why. */
spw_status spw__backend_cuda_create(const spw_backend_params *p, spw_backend **out) {
    (void)p;
    if (out) *out = NULL;
    return spw__error(SPW_ERR_NO_DEVICE,
                      "this build has no cuda backend (built without the CUDA toolkit)");
}

int spw__backend_cuda_available(void) { return 0; }
#endif
