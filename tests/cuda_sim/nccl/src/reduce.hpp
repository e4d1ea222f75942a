// NCCL's element types and reductions on the host, as its kernels compute them: inputs folded in
// rank order (so every rank gets the same bits), half and bfloat16 rounded to their type after
// every step (as __hadd and __hmul do), ncclAvg as a pre-multiplication by 1/nranks (rounded to
// the type) for floating types and a truncating division of the wrapped sum for integers.
#pragma once

#include <nccl.h>

#include <cstddef>

namespace simnccl {

/// Bytes per element, 0 for a value that is no ncclDataType_t.
std::size_t type_size(ncclDataType_t type) noexcept;

/// Whether the simulator reduces this type (every type but the two fp8 formats).
bool reducible(ncclDataType_t type) noexcept;

/// NCCL's name of a type or an op, for messages.
const char* type_name(ncclDataType_t type) noexcept;
const char* op_name(ncclRedOp_t op) noexcept;

/// out[i] = inputs[0][i] op inputs[1][i] op ... for i < count, in rank order (the reduction of
/// `nranks` contributions). out may be any of the inputs.
void reduce(ncclDataType_t type, ncclRedOp_t op, int nranks, const std::byte* const* inputs,
            std::byte* out, std::size_t count);

/// The bits of a half or bfloat16 from a double, rounded to nearest even (for tests as well).
unsigned short to_half(double value) noexcept;
unsigned short to_bfloat16(double value) noexcept;
double from_half(unsigned short bits) noexcept;
double from_bfloat16(unsigned short bits) noexcept;

}  // namespace simnccl
