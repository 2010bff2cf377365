// Python binding of kernels/cpu_argmax.h (see there).
#include "cpu_argmax.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &sluice::sample::argmax_rows, "first maximum of each row, NaN as the maximum (float32, CPU)");
}
