// The C++ CPU kernels (kernels/cpu_*.h) as one Python extension module, built from this one translation
// unit by kernels/cpu_extension.py: torch's and pybind11's headers, most of a kernel's compile time, are
// parsed once for all of them rather than once per kernel. Each kernel's functions are the submodule named
// after its header (`load_cpu_extension("cpu_rms_norm")` is the `cpu_rms_norm` submodule).
#include <torch/python.h>

#include "cpu_argmax.h"
#include "cpu_decoder_stack.h"
#include "cpu_packed_linear.h"
#include "cpu_paged_attention.h"
#include "cpu_rms_norm.h"
#include "cpu_rotary.h"
#include "cpu_silu_and_mul.h"

namespace {

void bind_argmax(pybind11::module_ m) {
  m.def("argmax_rows", &sluice::sample::argmax_rows, "first maximum of each row, NaN as the maximum (float32, CPU)");
}

void bind_decoder_stack(pybind11::module_ m) {
  using sluice::stack::DecoderStack;
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<const std::vector<torch::Tensor>&, const std::vector<torch::Tensor>&,
                          const std::vector<std::optional<torch::Tensor>>&, const std::vector<torch::Tensor>&,
                          const std::vector<torch::Tensor>&, const std::vector<torch::Tensor>&,
                          const std::vector<torch::Tensor>&, const std::vector<int64_t>&,
                          const std::vector<std::vector<std::optional<sluice::stack::Quantized>>>&, torch::Tensor,
                          int64_t, int64_t, int64_t, int64_t, double, double>())
      // Tensors only from here on: other Python threads run while a step (up to seconds on a prefill) does.
      .def("forward", &DecoderStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "One step through every layer and the final norm")
      .def_property("team", &DecoderStack::team, &DecoderStack::set_team,
                    "Whether a step runs as one team of threads (kernels/cpu_team.h) or a parallel region per kernel");
  m.def("team_barrier_check", &sluice::stack::team_barrier_check, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "The team barrier's self-check (tests): rounds whose count was wrong; failing_thread >= 0 throws");
  m.def("team_spun_waits", &sluice::stack::team_spun_waits, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "The team's barrier with its threads pinned, to one CPU or one each (tests): how many waits spun");
}

void bind_packed_linear(pybind11::module_ m) {
  m.attr("PANEL") = sluice::linear::kPanel;
  m.def("packed_linear",
        static_cast<void (*)(torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                             const c10::optional<torch::Tensor>&)>(&sluice::linear::packed_linear),
        "y = x W^T (+ b) with W packed in column panels (float32)");
}

void bind_paged_attention(pybind11::module_ m) {
  m.def("paged_attention", &sluice::attention::paged_attention,
        "Paged attention over a mixed batch, K/V read through block tables");
  m.def("store_kv", &sluice::attention::store_kv_or_first_bad_token,
        "This step's K/V into the paged cache at slot_mapping (slot < 0 skipped); writes nothing and returns "
        "the first token whose slot is past the cache if there is one, else -1");
}

void bind_rms_norm(pybind11::module_ m) {
  m.def("rms_norm",
        static_cast<void (*)(torch::Tensor&, torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&,
                             const torch::Tensor&, double)>(&sluice::norm::rms_norm),
        "RMSNorm with the residual add fused (float32, CPU)");
}

void bind_rotary(pybind11::module_ m) {
  m.def("rotary_embedding", &sluice::rotary::rotary_embedding, "Rotary embedding of q and k in place (float32, CPU)");
}

void bind_silu_and_mul(pybind11::module_ m) {
  m.def("silu_and_mul",
        static_cast<void (*)(torch::Tensor&, const torch::Tensor&)>(&sluice::activation::silu_and_mul),
        "silu(gate) * up over [gate | up] rows (float32, CPU)");
}

}  // namespace

// The submodules' names are kernels/cpu_extension.py's KERNELS.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_argmax(m.def_submodule("cpu_argmax"));
  bind_decoder_stack(m.def_submodule("cpu_decoder_stack"));
  bind_packed_linear(m.def_submodule("cpu_packed_linear"));
  bind_paged_attention(m.def_submodule("cpu_paged_attention"));
  bind_rms_norm(m.def_submodule("cpu_rms_norm"));
  bind_rotary(m.def_submodule("cpu_rotary"));
  bind_silu_and_mul(m.def_submodule("cpu_silu_and_mul"));
}
