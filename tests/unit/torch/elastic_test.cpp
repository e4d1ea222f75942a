// The libtorch bridge under tandem::Elastic (tandem/torch/elastic.hpp): three LocalComm ranks
// (threads meeting in a FileStore) train a Sequential with a SyncBatchNorm through
// torch::DistributedDataParallel with tandem's SGD; one rank thread leaves at a step; the two
// survivors heal (ddp.release(), rebind_sync_batchnorm, ddp.rebind(comm)) and finish every step
// with the same parameters, the optimizer and its momentum kept across the heal (same arena),
// the SyncBatchNorm and DDP reducing over the two of them. Also: the wrapper refuses work while
// released and a rebind without release.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <torch/torch.h>

#include "support/error_of.hpp"
#include "tandem/comm/local/local.hpp"
#include "tandem/elastic/elastic.hpp"
#include "tandem/optim/sgd.hpp"
#include "tandem/rendezvous/file_store.hpp"
#include "tandem/torch.hpp"
#include "tandem/torch/elastic.hpp"

using tandem::LocalComm;
using tandem::test::contains;
using tandem::test::error_of;

namespace {

/// Linear(6, 8) - BatchNorm1d(8) - Tanh - Linear(8, 3), initialised from `seed`.
torch::nn::Sequential make_net(std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::BatchNorm1d(8),
                               torch::nn::Tanh(), torch::nn::Linear(8, 3));
}

/// Step s's batch of 8 samples for member m (a function of both alone).
std::pair<torch::Tensor, torch::Tensor> batch_of(std::int64_t step, int member) {
  const auto seed = static_cast<double>(step * 7 + member);
  auto x = torch::sin(torch::arange(48, torch::kFloat32).reshape({8, 6}) * 0.37 + seed);
  auto y = torch::remainder(torch::arange(8, torch::kLong) + step + member, 3);
  return {x, y};
}

/// What a rank thread saw: whether it finished, its parameters, the groups' sizes.
struct Outcome {
  bool finished = false;
  std::string error;
  std::vector<float> params;
  int heals = 0;
  int final_size = 0;
  int sync_bn_size = 0;
  int momentum_steps = 0;
};

struct LeftTheGroup {};

}  // namespace

TEST_CASE("the bridge under Elastic: a rank leaves, the survivors heal and finish alike") {
  torch::set_num_threads(1);
  const auto dir = std::filesystem::temp_directory_path() /
                   ("tandem-torch-elastic-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  constexpr int ranks = 3;
  constexpr int victim = 2;
  constexpr std::int64_t steps = 8;
  constexpr std::int64_t leave_at = 3;
  std::vector<torch::nn::Sequential> nets;
  for (int r = 0; r < ranks; ++r) nets.push_back(make_net(5));  // made on one thread
  tandem::AnyStore store(tandem::FileStore(dir / "store"));
  std::vector<Outcome> outcomes(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      auto& out = outcomes[static_cast<std::size_t>(r)];
      try {
        using Comm = LocalComm;
        tandem::Elastic<Comm> elastic(tandem::World::single_node(r, ranks), store,
                                      tandem::LocalCommOptions{std::chrono::seconds(60)},
                                      {.window = std::chrono::seconds(60)});
        auto& net = nets[static_cast<std::size_t>(r)];
        const auto converted = tandem::torch::convert_sync_batchnorm(*net, elastic.comm());
        DOCTEST_CHECK(converted.converted.size() == 1);
        tandem::torch::DistributedDataParallel<Comm, tandem::overlap> ddp(elastic.comm(), net);
        tandem::optim::SGD sgd(ddp.parameters(), {.lr = 0.05, .momentum = 0.9});
        elastic.on_heal([&] { ddp.release(); },
                        [&](Comm& comm) {
                          const auto moved = tandem::torch::rebind_sync_batchnorm(*net, comm);
                          DOCTEST_CHECK(moved.converted.size() == 1);
                          ddp.rebind(comm);
                        });
        while (elastic.steps_done() < steps) {
          const std::int64_t step = elastic.steps_done();
          if (r == victim && step == leave_at) throw LeftTheGroup{};
          elastic.step(
              [&](Comm& comm) {
                const auto [x, y] = batch_of(step, comm.rank());
                sgd.zero_grad();
                ddp.before_forward();  // Sequential's forward is a template: called directly
                torch::nn::functional::cross_entropy(net->forward(x), y).backward();
              },
              [&] { sgd.step(); });
        }
        const auto values = ddp.parameters().values();
        out.params.assign(values.data(), values.data() + values.size());
        out.heals = elastic.heals();
        out.final_size = ddp.comm().size();
        for (const auto& module : net->modules(/*include_self=*/false)) {
          if (auto sync = std::dynamic_pointer_cast<tandem::torch::SyncBatchNormImpl>(module))
            out.sync_bn_size = sync->world_size();
        }
        out.finished = true;
      } catch (const LeftTheGroup&) {
        // the victim: its Elastic and communicator are gone with this scope
      } catch (const std::exception& e) {
        out.error = e.what();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  std::filesystem::remove_all(dir);
  for (int r = 0; r < ranks; ++r) {
    if (r == victim) continue;
    const auto& out = outcomes[static_cast<std::size_t>(r)];
    DOCTEST_CAPTURE(r);
    DOCTEST_CAPTURE(out.error);
    DOCTEST_REQUIRE(out.finished);
    DOCTEST_CHECK(out.heals == 1);
    DOCTEST_CHECK(out.final_size == 2);
    DOCTEST_CHECK(out.sync_bn_size == 2);
  }
  // The survivors hold the same parameters, bit for bit, and training moved them.
  DOCTEST_CHECK(outcomes[0].params == outcomes[1].params);
  auto untouched = make_net(5);
  std::vector<float> initial;
  for (const auto& p : untouched->parameters()) {
    const auto flat = p.detach().contiguous().view(-1);
    initial.insert(initial.end(), flat.data_ptr<float>(), flat.data_ptr<float>() + flat.numel());
  }
  DOCTEST_CHECK(initial.size() == outcomes[0].params.size());
  DOCTEST_CHECK(initial != outcomes[0].params);
}

TEST_CASE("misuse: the bridge's DDP released from its group refuses work; rebind needs release") {
  torch::set_num_threads(1);
  std::vector<torch::nn::Sequential> nets;
  for (int r = 0; r < 2; ++r) nets.push_back(make_net(9));
  std::vector<std::string> forward_error(2), rebind_error(2);
  std::vector<bool> works_again(2, false);
  tandem::run_local(2, [&](LocalComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    tandem::torch::DistributedDataParallel ddp(comm, nets[r]);
    rebind_error[r] = error_of([&] { ddp.rebind(comm); });
    ddp.release();
    ddp.release();  // again: nothing
    const auto [x, y] = batch_of(0, comm.rank());
    forward_error[r] = error_of([&] { ddp.before_forward(); });
    ddp.rebind(comm);
    ddp.before_forward();
    torch::nn::functional::cross_entropy(nets[r]->forward(x), y).backward();
    works_again[r] = nets[r]->parameters()[0].grad().defined();
  });
  for (int r = 0; r < 2; ++r) {
    DOCTEST_CAPTURE(forward_error[r]);
    DOCTEST_CAPTURE(rebind_error[r]);
    DOCTEST_CHECK(contains(forward_error[r], "rank " + std::to_string(r)));
    DOCTEST_CHECK(contains(forward_error[r], "released"));
    DOCTEST_CHECK(contains(rebind_error[r], "call release() first"));
    DOCTEST_CHECK(works_again[r]);
  }
}
