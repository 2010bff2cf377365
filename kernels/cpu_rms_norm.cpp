// Python binding of kernels/cpu_rms_norm.h (see there).
#include "cpu_rms_norm.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm",
        static_cast<void (*)(torch::Tensor&, torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&,
                             const torch::Tensor&, double)>(&sluice::norm::rms_norm),
        "RMSNorm with the residual add fused (float32, CPU)");
}
