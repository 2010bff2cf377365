// Python binding of kernels/cpu_paged_attention.h (see there).
#include "cpu_paged_attention.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &sluice::attention::paged_attention,
        "Paged attention over a mixed batch, K/V read through block tables");
  m.def("store_kv", &sluice::attention::store_kv_or_first_bad_token,
        "This step's K/V into the paged cache at slot_mapping (slot < 0 skipped); writes nothing and returns "
        "the first token whose slot is past the cache if there is one, else -1");
}
