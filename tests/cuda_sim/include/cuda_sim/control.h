/* cuda_sim/control.h - what only the simulated CUDA runtime has: its device count, stress mode,
 * fault injection and counters for tests (tests/cuda_sim/README.md).
 *   cuda_sim_inject_fault(0, cudaErrorIllegalAddress);   // device 0 fails as after a kernel fault
 *   CHECK(cudaStreamSynchronize(stream) == cudaErrorIllegalAddress);
 * Needs: the simulated runtime (target tandem_cuda_sim_runtime); C or C++. These calls never take
 * part in CUDA's error state (cudaGetLastError) and may be made from any thread, stream work
 * (host functions) included. */
#ifndef CUDA_SIM_CONTROL_H
#define CUDA_SIM_CONTROL_H

#include <stddef.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/** The most devices the simulator can show (TANDEM_CUDA_SIM_DEVICES is capped here). */
#define CUDA_SIM_MAX_DEVICES 64

/** The number of devices this process sees: TANDEM_CUDA_SIM_DEVICES (default 4), narrowed by
 * CUDA_VISIBLE_DEVICES as CUDA narrows it, or the last cuda_sim_set_device_count(). What
 * cudaGetDeviceCount reports (without its cudaErrorNoDevice for 0). */
int cuda_sim_device_count(void);

/** Shows `count` devices (0 to CUDA_SIM_MAX_DEVICES) from now on, numbered 0..count-1: those
 * shown at start-up keep their identity (UUID, PCI bus), the others are named by their number.
 * Streams and memory already made on devices no longer shown keep working; a host thread whose
 * current device is no longer shown gets cudaErrorInvalidDevice from calls on it until it calls
 * cudaSetDevice. Returns cudaErrorInvalidValue for a count out of range. */
cudaError_t cuda_sim_set_device_count(int count);

/** Stress mode on (enabled != 0) or off: every stream task then starts after a delay of 0 to
 * 300 microseconds, drawn from `seed`, the stream's creation number and the task's number: the
 * same for a seed wherever the program makes its streams in the same order.
 * TANDEM_CUDA_SIM_STRESS=<seed> turns it on at start-up. */
void cuda_sim_set_stress(int enabled, unsigned long long seed);

/** Whether stress mode is on; its seed is stored in *seed when seed is not NULL. Other simulated
 * libraries (NCCL's) read it to stress their own choices the same way. */
int cuda_sim_stress_enabled(unsigned long long* seed);

/** Makes `device`'s context fail with `error` as after a kernel fault: the error is sticky, so
 * every later call touching the device (its streams, events and memory, its synchronisation, and
 * cudaGetLastError and cudaPeekAtLastError while it is current) returns it, host functions queued
 * on its streams are skipped and stream callbacks get it as their status. Returns
 * cudaErrorInvalidDevice for a device not shown, cudaErrorInvalidValue for cudaSuccess. */
cudaError_t cuda_sim_inject_fault(int device, cudaError_t error);

/** Clears `device`'s injected fault (a real context stays failed until the process ends: this is
 * for tests that go on in the same process). Returns cudaErrorInvalidDevice for a device not
 * shown. */
cudaError_t cuda_sim_clear_fault(int device);

/** Bytes of device memory allocated on `device` (cudaMalloc, cudaMallocAsync) and not yet freed;
 * a stream-ordered free counts once its stream has reached it. 0 for a device not shown. */
size_t cuda_sim_device_bytes_outstanding(int device);

/** Bytes of pinned host memory (cudaHostAlloc, cudaMallocHost) not yet freed, all devices. */
size_t cuda_sim_pinned_bytes_outstanding(void);

/** Stream tasks (copies, memsets, host functions, waits, event markers, frees, GEMMs) that have
 * run on `device`'s streams so far. 0 for a device not shown. */
unsigned long long cuda_sim_tasks_run(int device);

/** The stream worker threads alive now (one per stream not yet destroyed and drained). */
int cuda_sim_worker_threads(void);

/** Non-zero when the calling thread is a stream's worker, i.e. inside a host function or a
 * callback, where CUDA calls other than cudaGetDevice, cudaGetDeviceCount, cudaGetLastError,
 * cudaPeekAtLastError, cudaGetErrorName and cudaGetErrorString return cudaErrorNotPermitted. */
int cuda_sim_in_stream_work(void);

#ifdef __cplusplus
}
#endif

#endif /* CUDA_SIM_CONTROL_H */
