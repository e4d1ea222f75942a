// bench/torch_resnet/sbn_layer_cost.cpp - what one libtorch SyncBatchNorm layer costs in CPU
// time, forward and backward, against libtorch's own training-mode batch_norm, at the ResNet
// example's shapes (batch 64; 24 channels of 14x14, 48 of 7x7, 96 of 4x4). The synchronised
// path runs in full (the autograd node, its all_gather and all_reduce) over a 1-rank LocalComm,
// so no rank waits for another: the difference is the library's own work. Time is the thread's
// CPU time (CLOCK_THREAD_CPUTIME_ID), which a machine shared with other jobs disturbs less than
// wall time; each figure is the second fastest of 7 batches of 100 steps.
// Built by hand (no CMake target; compare two trees by their include directory):
//   g++ -std=c++20 -O2 -DNDEBUG -Iinclude -isystem /usr/include/torch/csrc/api/include
//     bench/torch_resnet/sbn_layer_cost.cpp -o sbn_layer_cost -ltorch -ltorch_cpu -lc10 -lpthread
//   (one command line)
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "tandem/comm/local/local.hpp"
#include "tandem/torch/sync_batch_norm.hpp"

namespace {

double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

/// Microseconds of CPU per call of `step`: the second fastest of 7 batches of 100 calls.
template <class Step>
double microseconds_per_step(Step&& step) {
  std::vector<double> batches;
  for (int batch = 0; batch < 7; ++batch) {
    const double start = thread_seconds();
    for (int i = 0; i < 100; ++i) step();
    batches.push_back((thread_seconds() - start) / 100 * 1e6);
  }
  std::sort(batches.begin(), batches.end());
  return batches[1];
}

}  // namespace

int main() {
  torch::set_num_threads(1);
  namespace sbn = tandem::torch::detail::sync_batch_norm;
  tandem::run_local(1, [](tandem::LocalComm& comm) {
    const auto group = std::make_shared<const sbn::Group>(comm);
    struct Shape {
      int64_t channels, side;
    };
    for (const Shape s : {Shape{24, 14}, Shape{48, 7}, Shape{96, 4}}) {
      const auto x = torch::randn({64, s.channels, s.side, s.side});
      const auto dy = torch::randn({64, s.channels, s.side, s.side});
      const auto weight = torch::rand({s.channels}).requires_grad_(true);
      const auto bias = torch::randn({s.channels}).requires_grad_(true);
      const auto running_mean = torch::zeros({s.channels});
      const auto running_var = torch::ones({s.channels});
      const auto tracked = torch::zeros({}, torch::kLong);
      const double synchronised = microseconds_per_step([&] {
        const auto input = x.clone().requires_grad_(true);
        sbn::ForwardArgs args;
        args.group = group;
        args.running_mean = running_mean;
        args.running_var = running_var;
        args.num_batches_tracked = tracked;
        sbn::Function::apply(input, weight, bias, args).backward(dy);
      });
      const double plain = microseconds_per_step([&] {
        const auto input = x.clone().requires_grad_(true);
        torch::batch_norm(input, weight, bias, running_mean, running_var, /*training=*/true, 0.1,
                          1e-5, /*cudnn_enabled=*/false)
            .backward(dy);
      });
      std::printf("RESULT channels=%lld side=%lld synchronised_us=%.1f batch_norm_us=%.1f\n",
                  static_cast<long long>(s.channels), static_cast<long long>(s.side), synchronised,
                  plain);
    }
  });
}
