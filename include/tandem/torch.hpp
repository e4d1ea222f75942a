// tandem/torch.hpp - the libtorch bridge: libtorch (torch::nn) models trained data-parallel by
// tandem, on any Communicator.
//   tandem::torch::convert_sync_batchnorm(*model, comm);        // optional, as in PyTorch
//   tandem::torch::DistributedDataParallel ddp(comm, model);    // model: shared_ptr<Net>
//   auto loss = torch::nn::functional::cross_entropy(ddp.forward(x), y);
//   opt.zero_grad(); loss.backward(); opt.step();               // averaged when backward returns
//   tandem::torch::model(state, ddp);                           // checkpoints with state_dict keys
// Needs: libtorch 1.13 or 2.x (the tandem::torch CMake component). CUDA modules (over NcclComm)
// also need <tandem/torch/cuda.hpp>, in a .cu file (libtorch with CUDA).
#pragma once

#include "tandem/torch/ddp.hpp"
#include "tandem/torch/state_dict.hpp"
#include "tandem/torch/sync_batch_norm.hpp"
#include "tandem/torch/tensor.hpp"
