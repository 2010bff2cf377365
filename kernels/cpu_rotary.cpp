// Python binding of kernels/cpu_rotary.h (see there).
#include "cpu_rotary.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_embedding", &sluice::rotary::rotary_embedding, "Rotary embedding of q and k in place (float32, CPU)");
}
