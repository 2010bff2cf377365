// Python binding of kernels/cpu_packed_linear.h (see there).
#include "cpu_packed_linear.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("PANEL") = sluice::linear::kPanel;
  m.def("packed_linear",
        static_cast<void (*)(torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                             const c10::optional<torch::Tensor>&)>(&sluice::linear::packed_linear),
        "y = x W^T (+ b) with W packed in column panels (float32)");
}
