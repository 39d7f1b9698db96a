// Tandem's binding of FlashMLA's dense MLA decode (sm90a, bf16) only: FlashMLA's own api.cpp also binds the
// sparse and sm100 kernels, which would multiply the build time for nothing Tandem calls.
#include <pybind11/pybind11.h>

#include "api/dense_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA dense decode (sm90a, bf16), built by kernels/flashmla/build.py";
    m.def("dense_decode_fwd", &dense_attn_decode_interface);
}
