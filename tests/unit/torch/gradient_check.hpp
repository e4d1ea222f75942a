// tests/unit/torch/gradient_check.hpp - what the torch bridge's DDP tests share (ddp_test.cpp on
// LocalComm threads, processes_test.cpp on GlooComm and MpiComm processes): a small Net, a batch
// split over ranks and micro-batches, one process's reference gradients over the whole batch,
// and the gradients DDP leaves after backward().
//   const auto want = reference_grads(reference_net, data, n, micro, spare);
//   check_close(ddp_grads<tandem::sync_at_end>(comm, net, data, micro), want, "rank 1");
// Tolerance: 1e-5 relative plus 1e-6 absolute. The ranks' mean is the sum of per-rank float
// gradients (in the backend's order) divided by n, the reference a float sum over the same slices
// in another order: the same numbers up to a few roundings of values of order 1.
// Needs: doctest (DOCTEST_ macros: libtorch's glog takes CHECK), libtorch, tandem/torch.hpp.
#pragma once

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "tandem/torch.hpp"

// Outside namespace tandem: TORCH_MODULE names torch::nn unqualified, which tandem::torch hides.
namespace torch_ddp_check {

/// Two layers around a BatchNorm (float running statistics, the int64 num_batches_tracked), a
/// float buffer and an int64 one of its own, and a branch used only where asked (a parameter
/// that some ranks leave unused).
struct NetImpl : ::torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", ::torch::nn::Linear(6, 8));
    bn = register_module("bn", ::torch::nn::BatchNorm1d(8));
    fc2 = register_module("fc2", ::torch::nn::Linear(8, 3));
    spare = register_module("spare", ::torch::nn::Linear(8, 3));
    scale = register_buffer("scale", ::torch::ones({8}));
    count = register_buffer("count", ::torch::zeros({1}, ::torch::kLong));
  }
  ::torch::Tensor forward(::torch::Tensor x) {
    auto h = ::torch::tanh(bn->forward(fc1->forward(x))) * scale;
    auto out = fc2->forward(h);
    if (use_spare) out = out + spare->forward(h);
    return out;
  }
  ::torch::nn::Linear fc1{nullptr}, fc2{nullptr}, spare{nullptr};
  ::torch::nn::BatchNorm1d bn{nullptr};
  ::torch::Tensor scale, count;
  bool use_spare = false;
};
TORCH_MODULE(Net);

/// A Net initialised from `seed` (libtorch's generator is global: ranks that are threads must
/// not draw from it at once, so make theirs on one thread).
inline Net net_from(std::uint64_t seed) {
  ::torch::manual_seed(seed);
  return Net();
}

constexpr int batch = 24;  // divides by 1, 2, 3 and 4 ranks, and by their micro-batches here

/// The whole batch, the same wherever it is made from the same seed.
struct Data {
  explicit Data(std::uint64_t seed = 1) {
    ::torch::manual_seed(seed);
    x = ::torch::randn({batch, 6});
    y = ::torch::randint(0, 3, {batch}, ::torch::kLong);
  }
  ::torch::Tensor x, y;
};

/// Rank r's slice of micro-batch m (of `micro`) when the batch is split over n ranks.
inline std::pair<::torch::Tensor, ::torch::Tensor> slice(const Data& d, int n, int r, int micro,
                                                         int m) {
  const int per = batch / n / micro;
  const int from = r * (batch / n) + m * per;
  return {d.x.slice(0, from, from + per), d.y.slice(0, from, from + per)};
}

/// Whether rank r runs the spare branch.
using SpareUse = std::function<bool(int rank)>;
inline const SpareUse nowhere = [](int) { return false; };
inline const SpareUse everywhere = [](int) { return true; };

/// What DDP must leave in every rank's gradients, computed by one process on `net`: the mean over
/// ranks of each rank's summed micro-batch gradients (rank r uses the branch when spare(r)).
inline std::vector<::torch::Tensor> reference_grads(Net& net, const Data& d, int n, int micro,
                                                    const SpareUse& spare) {
  net->zero_grad();
  for (int r = 0; r < n; ++r) {
    net->use_spare = spare(r);
    for (int m = 0; m < micro; ++m) {
      auto [x, y] = slice(d, n, r, micro, m);
      (::torch::nn::functional::cross_entropy(net->forward(x), y) / n).backward();
    }
  }
  std::vector<::torch::Tensor> grads;
  for (auto& p : net->parameters()) {
    grads.push_back(p.grad().defined() ? p.grad().clone() : ::torch::zeros_like(p));
  }
  return grads;
}

/// This rank's gradients after DDP (with Policies) over `comm`: `micro` micro-batches of its
/// slice, all but the last under no_sync, starting from gradients set to none.
template <class... Policies, class Comm>
std::vector<::torch::Tensor> ddp_grads(Comm& comm, Net net, const Data& data, int micro) {
  const int n = comm.size();
  const int r = comm.rank();
  tandem::torch::DistributedDataParallel<Comm, Policies...> ddp(comm, net.ptr());
  for (auto& p : net->parameters()) p.mutable_grad() = ::torch::Tensor();  // set_to_none
  {
    auto guard = ddp.no_sync();
    for (int m = 0; m + 1 < micro; ++m) {
      auto [x, y] = slice(data, n, r, micro, m);
      ::torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
    }
  }
  auto [x, y] = slice(data, n, r, micro, micro - 1);
  ::torch::nn::functional::cross_entropy(ddp.forward(x), y).backward();
  std::vector<::torch::Tensor> grads;
  for (auto& p : net->parameters()) grads.push_back(p.grad().clone());
  return grads;
}

/// Each gradient within the tolerance (see the top) of the reference's.
inline void check_close(const std::vector<::torch::Tensor>& got,
                        const std::vector<::torch::Tensor>& want, const std::string& what) {
  DOCTEST_REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool close = ::torch::allclose(got[i], want[i], 1e-5, 1e-6);
    DOCTEST_CHECK_MESSAGE(close, what << ": gradient " << i << " differs by "
                                      << (got[i] - want[i]).abs().max().item<float>());
  }
}

}  // namespace torch_ddp_check
