// Python binding of kernels/cpu_silu_and_mul.h (see there).
#include "cpu_silu_and_mul.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_and_mul",
        static_cast<void (*)(torch::Tensor&, const torch::Tensor&)>(&sluice::activation::silu_and_mul),
        "silu(gate) * up over [gate | up] rows (float32, CPU)");
}
