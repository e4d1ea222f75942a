// The runtime's global state, devices, their properties, errors, fork and the control calls
// (cuda_sim/control.h).
#include <pthread.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cuda_sim/control.h"
#include "internal.hpp"

namespace cuda_sim {

bool forked_child = false;

namespace {

int environment_int(const char* name, int fallback, int low, int high) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (*end != '\0' || value < low || value > high) return fallback;
  return static_cast<int>(value);
}

/// The physical devices CUDA_VISIBLE_DEVICES shows, in its order: as CUDA reads it, the list ends
/// at the first entry that is not a device (or repeats one). Unset: all of them.
std::vector<int> visible_devices(int physical) {
  std::vector<int> order;
  const char* list = std::getenv("CUDA_VISIBLE_DEVICES");
  if (list == nullptr) {
    for (int d = 0; d < physical; ++d) order.push_back(d);
    return order;
  }
  const std::string text = list;
  for (std::size_t start = 0; start < text.size();) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    std::string entry = text.substr(start, comma - start);
    entry.erase(0, entry.find_first_not_of(" \t"));
    entry.erase(entry.find_last_not_of(" \t") + 1);
    char* end = nullptr;
    const long value = entry.empty() ? -1 : std::strtol(entry.c_str(), &end, 10);
    if (value < 0 || value >= physical || *end != '\0' ||
        std::find(order.begin(), order.end(), static_cast<int>(value)) != order.end()) {
      break;
    }
    order.push_back(static_cast<int>(value));
    start = comma + 1;
  }
  return order;
}

void mark_forked_child() {
  forked_child = true;
}

}  // namespace

Runtime::Runtime() {
  const int physical = environment_int("TANDEM_CUDA_SIM_DEVICES", 4, 0, max_devices);
  const std::vector<int> order = visible_devices(physical);
  for (int d = 0; d < max_devices; ++d) {
    Device& device = devices[static_cast<std::size_t>(d)];
    device.ordinal = d;
    device.physical = d < static_cast<int>(order.size()) ? order[static_cast<std::size_t>(d)] : d;
  }
  visible.store(static_cast<int>(order.size()), std::memory_order_relaxed);
  if (const char* seed = std::getenv("TANDEM_CUDA_SIM_STRESS"); seed != nullptr && *seed != '\0') {
    stress_seed.store(std::strtoull(seed, nullptr, 10), std::memory_order_relaxed);
    stress.store(true, std::memory_order_relaxed);
  }
  // A forked child has none of the workers: like CUDA, refuse every call there.
  pthread_atfork(nullptr, nullptr, mark_forked_child);
}

Runtime& runtime() {
  static Runtime* const instance = new Runtime();  // never destroyed (see internal.hpp)
  return *instance;
}

ThreadState& this_thread() {
  thread_local ThreadState state;
  return state;
}

cudaError_t admit(bool allowed_in_work) noexcept {
  if (forked_child) return cudaErrorInitializationError;
  (void)runtime();
  if (!allowed_in_work && this_thread().worker_of != nullptr) return cudaErrorNotPermitted;
  return cudaSuccess;
}

cudaError_t result(cudaError_t status) noexcept {
  if (status != cudaSuccess && status != cudaErrorNotReady) this_thread().last_error = status;
  return status;
}

Device* device_at(int ordinal) noexcept {
  Runtime& rt = runtime();
  if (ordinal < 0 || ordinal >= rt.visible.load(std::memory_order_relaxed)) return nullptr;
  return &rt.devices[static_cast<std::size_t>(ordinal)];
}

cudaError_t current_device(Device*& device) noexcept {
  if (runtime().visible.load(std::memory_order_relaxed) == 0) return cudaErrorNoDevice;
  device = device_at(this_thread().device);
  return device != nullptr ? cudaSuccess : cudaErrorInvalidDevice;
}

}  // namespace cuda_sim

using namespace cuda_sim;

namespace {

/// The simulated device's properties: a modest GPU of compute capability 9.0.
cudaDeviceProp properties_of(const Device& device) {
  cudaDeviceProp prop{};
  const std::string name = "tandem cuda_sim device " + std::to_string(device.physical);
  std::snprintf(prop.name, sizeof prop.name, "%s", name.c_str());
  const char tag[] = "tandem-cuda-sim";
  std::memcpy(prop.uuid.bytes, tag, 15);
  prop.uuid.bytes[15] = static_cast<char>(device.physical);
  prop.totalGlobalMem = runtime().device_capacity.load(std::memory_order_relaxed);
  prop.sharedMemPerBlock = 48 * 1024;
  prop.regsPerBlock = 65536;
  prop.warpSize = 32;
  prop.memPitch = 2147483647;
  prop.maxThreadsPerBlock = 1024;
  prop.maxThreadsDim[0] = 1024;
  prop.maxThreadsDim[1] = 1024;
  prop.maxThreadsDim[2] = 64;
  prop.maxGridSize[0] = 2147483647;
  prop.maxGridSize[1] = 65535;
  prop.maxGridSize[2] = 65535;
  prop.totalConstMem = 65536;
  prop.major = 9;
  prop.minor = 0;
  prop.textureAlignment = 512;
  prop.texturePitchAlignment = 32;
  prop.multiProcessorCount = 8;
  prop.canMapHostMemory = 1;
  prop.surfaceAlignment = 512;
  prop.concurrentKernels = 1;
  prop.pciBusID = 0x10 + device.physical;
  prop.asyncEngineCount = 2;
  prop.unifiedAddressing = 1;
  prop.memoryBusWidth = 5120;
  prop.l2CacheSize = 50 * 1024 * 1024;
  prop.maxThreadsPerMultiProcessor = 2048;
  prop.streamPrioritiesSupported = 1;
  prop.globalL1CacheSupported = 1;
  prop.localL1CacheSupported = 1;
  prop.sharedMemPerMultiprocessor = 228 * 1024;
  prop.regsPerMultiprocessor = 65536;
  prop.computePreemptionSupported = 1;
  prop.canUseHostPointerForRegisteredMem = 1;
  prop.sharedMemPerBlockOptin = 227 * 1024;
  prop.maxBlocksPerMultiProcessor = 32;
  prop.hostRegisterSupported = 1;
  prop.memoryPoolsSupported = 1;
  prop.deviceNumaId = -1;
  prop.hostNumaId = -1;
  return prop;
}

/// The attribute's value from the properties; false for one the simulator does not know.
bool attribute_of(const cudaDeviceProp& prop, cudaDeviceAttr attribute, int& value) {
  const std::pair<cudaDeviceAttr, int> known[] = {
      {cudaDevAttrMaxThreadsPerBlock, prop.maxThreadsPerBlock},
      {cudaDevAttrMaxBlockDimX, prop.maxThreadsDim[0]},
      {cudaDevAttrMaxBlockDimY, prop.maxThreadsDim[1]},
      {cudaDevAttrMaxBlockDimZ, prop.maxThreadsDim[2]},
      {cudaDevAttrMaxGridDimX, prop.maxGridSize[0]},
      {cudaDevAttrMaxGridDimY, prop.maxGridSize[1]},
      {cudaDevAttrMaxGridDimZ, prop.maxGridSize[2]},
      {cudaDevAttrMaxSharedMemoryPerBlock, static_cast<int>(prop.sharedMemPerBlock)},
      {cudaDevAttrTotalConstantMemory, static_cast<int>(prop.totalConstMem)},
      {cudaDevAttrWarpSize, prop.warpSize},
      {cudaDevAttrMaxPitch, static_cast<int>(prop.memPitch)},
      {cudaDevAttrMaxRegistersPerBlock, prop.regsPerBlock},
      {cudaDevAttrClockRate, 1755000},
      {cudaDevAttrTextureAlignment, static_cast<int>(prop.textureAlignment)},
      {cudaDevAttrGpuOverlap, 1},
      {cudaDevAttrMultiProcessorCount, prop.multiProcessorCount},
      {cudaDevAttrKernelExecTimeout, 0},
      {cudaDevAttrIntegrated, prop.integrated},
      {cudaDevAttrCanMapHostMemory, prop.canMapHostMemory},
      {cudaDevAttrComputeMode, cudaComputeModeDefault},
      {cudaDevAttrConcurrentKernels, prop.concurrentKernels},
      {cudaDevAttrEccEnabled, prop.ECCEnabled},
      {cudaDevAttrPciBusId, prop.pciBusID},
      {cudaDevAttrPciDeviceId, prop.pciDeviceID},
      {cudaDevAttrPciDomainId, prop.pciDomainID},
      {cudaDevAttrTccDriver, prop.tccDriver},
      {cudaDevAttrMemoryClockRate, 2619000},
      {cudaDevAttrGlobalMemoryBusWidth, prop.memoryBusWidth},
      {cudaDevAttrL2CacheSize, prop.l2CacheSize},
      {cudaDevAttrMaxThreadsPerMultiProcessor, prop.maxThreadsPerMultiProcessor},
      {cudaDevAttrAsyncEngineCount, prop.asyncEngineCount},
      {cudaDevAttrUnifiedAddressing, prop.unifiedAddressing},
      {cudaDevAttrComputeCapabilityMajor, prop.major},
      {cudaDevAttrComputeCapabilityMinor, prop.minor},
      {cudaDevAttrStreamPrioritiesSupported, prop.streamPrioritiesSupported},
      {cudaDevAttrGlobalL1CacheSupported, prop.globalL1CacheSupported},
      {cudaDevAttrLocalL1CacheSupported, prop.localL1CacheSupported},
      {cudaDevAttrMaxSharedMemoryPerMultiprocessor,
       static_cast<int>(prop.sharedMemPerMultiprocessor)},
      {cudaDevAttrMaxRegistersPerMultiprocessor, prop.regsPerMultiprocessor},
      {cudaDevAttrManagedMemory, prop.managedMemory},
      {cudaDevAttrIsMultiGpuBoard, prop.isMultiGpuBoard},
      {cudaDevAttrMultiGpuBoardGroupID, prop.multiGpuBoardGroupID},
      {cudaDevAttrHostNativeAtomicSupported, prop.hostNativeAtomicSupported},
      {cudaDevAttrPageableMemoryAccess, prop.pageableMemoryAccess},
      {cudaDevAttrConcurrentManagedAccess, prop.concurrentManagedAccess},
      {cudaDevAttrComputePreemptionSupported, prop.computePreemptionSupported},
      {cudaDevAttrCanUseHostPointerForRegisteredMem, prop.canUseHostPointerForRegisteredMem},
      {cudaDevAttrCooperativeLaunch, prop.cooperativeLaunch},
      {cudaDevAttrMaxSharedMemoryPerBlockOptin, static_cast<int>(prop.sharedMemPerBlockOptin)},
      {cudaDevAttrHostRegisterSupported, prop.hostRegisterSupported},
      {cudaDevAttrPageableMemoryAccessUsesHostPageTables, 0},
      {cudaDevAttrDirectManagedMemAccessFromHost, 0},
      {cudaDevAttrMaxBlocksPerMultiprocessor, prop.maxBlocksPerMultiProcessor},
      {cudaDevAttrMemoryPoolsSupported, prop.memoryPoolsSupported},
      {cudaDevAttrGPUDirectRDMASupported, 0},
      {cudaDevAttrIpcEventSupport, 0},
      {cudaDevAttrClusterLaunch, 0},
      {cudaDevAttrNumaConfig, 0},
      {cudaDevAttrNumaId, -1},
      {cudaDevAttrHostNumaId, -1},
      {cudaDevAttrMpsEnabled, 0},
  };
  for (const auto& [name, known_value] : known) {
    if (name == attribute) {
      value = known_value;
      return true;
    }
  }
  return false;
}

const char* error_name(cudaError_t error) {
  static constexpr std::pair<cudaError_t, const char*> names[] = {
      {cudaSuccess, "cudaSuccess"},
      {cudaErrorInvalidValue, "cudaErrorInvalidValue"},
      {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation"},
      {cudaErrorInitializationError, "cudaErrorInitializationError"},
      {cudaErrorCudartUnloading, "cudaErrorCudartUnloading"},
      {cudaErrorProfilerDisabled, "cudaErrorProfilerDisabled"},
      {cudaErrorProfilerNotInitialized, "cudaErrorProfilerNotInitialized"},
      {cudaErrorProfilerAlreadyStarted, "cudaErrorProfilerAlreadyStarted"},
      {cudaErrorProfilerAlreadyStopped, "cudaErrorProfilerAlreadyStopped"},
      {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration"},
      {cudaErrorInvalidPitchValue, "cudaErrorInvalidPitchValue"},
      {cudaErrorInvalidSymbol, "cudaErrorInvalidSymbol"},
      {cudaErrorInvalidHostPointer, "cudaErrorInvalidHostPointer"},
      {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer"},
      {cudaErrorInvalidTexture, "cudaErrorInvalidTexture"},
      {cudaErrorInvalidTextureBinding, "cudaErrorInvalidTextureBinding"},
      {cudaErrorInvalidChannelDescriptor, "cudaErrorInvalidChannelDescriptor"},
      {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection"},
      {cudaErrorAddressOfConstant, "cudaErrorAddressOfConstant"},
      {cudaErrorTextureFetchFailed, "cudaErrorTextureFetchFailed"},
      {cudaErrorTextureNotBound, "cudaErrorTextureNotBound"},
      {cudaErrorSynchronizationError, "cudaErrorSynchronizationError"},
      {cudaErrorInvalidFilterSetting, "cudaErrorInvalidFilterSetting"},
      {cudaErrorInvalidNormSetting, "cudaErrorInvalidNormSetting"},
      {cudaErrorMixedDeviceExecution, "cudaErrorMixedDeviceExecution"},
      {cudaErrorNotYetImplemented, "cudaErrorNotYetImplemented"},
      {cudaErrorMemoryValueTooLarge, "cudaErrorMemoryValueTooLarge"},
      {cudaErrorStubLibrary, "cudaErrorStubLibrary"},
      {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver"},
      {cudaErrorCallRequiresNewerDriver, "cudaErrorCallRequiresNewerDriver"},
      {cudaErrorInvalidSurface, "cudaErrorInvalidSurface"},
      {cudaErrorDuplicateVariableName, "cudaErrorDuplicateVariableName"},
      {cudaErrorDuplicateTextureName, "cudaErrorDuplicateTextureName"},
      {cudaErrorDuplicateSurfaceName, "cudaErrorDuplicateSurfaceName"},
      {cudaErrorDevicesUnavailable, "cudaErrorDevicesUnavailable"},
      {cudaErrorIncompatibleDriverContext, "cudaErrorIncompatibleDriverContext"},
      {cudaErrorMissingConfiguration, "cudaErrorMissingConfiguration"},
      {cudaErrorPriorLaunchFailure, "cudaErrorPriorLaunchFailure"},
      {cudaErrorLaunchMaxDepthExceeded, "cudaErrorLaunchMaxDepthExceeded"},
      {cudaErrorLaunchFileScopedTex, "cudaErrorLaunchFileScopedTex"},
      {cudaErrorLaunchFileScopedSurf, "cudaErrorLaunchFileScopedSurf"},
      {cudaErrorSyncDepthExceeded, "cudaErrorSyncDepthExceeded"},
      {cudaErrorLaunchPendingCountExceeded, "cudaErrorLaunchPendingCountExceeded"},
      {cudaErrorInvalidDeviceFunction, "cudaErrorInvalidDeviceFunction"},
      {cudaErrorNoDevice, "cudaErrorNoDevice"},
      {cudaErrorInvalidDevice, "cudaErrorInvalidDevice"},
      {cudaErrorDeviceNotLicensed, "cudaErrorDeviceNotLicensed"},
      {cudaErrorSoftwareValidityNotEstablished, "cudaErrorSoftwareValidityNotEstablished"},
      {cudaErrorStartupFailure, "cudaErrorStartupFailure"},
      {cudaErrorInvalidKernelImage, "cudaErrorInvalidKernelImage"},
      {cudaErrorDeviceUninitialized, "cudaErrorDeviceUninitialized"},
      {cudaErrorMapBufferObjectFailed, "cudaErrorMapBufferObjectFailed"},
      {cudaErrorUnmapBufferObjectFailed, "cudaErrorUnmapBufferObjectFailed"},
      {cudaErrorArrayIsMapped, "cudaErrorArrayIsMapped"},
      {cudaErrorAlreadyMapped, "cudaErrorAlreadyMapped"},
      {cudaErrorNoKernelImageForDevice, "cudaErrorNoKernelImageForDevice"},
      {cudaErrorAlreadyAcquired, "cudaErrorAlreadyAcquired"},
      {cudaErrorNotMapped, "cudaErrorNotMapped"},
      {cudaErrorNotMappedAsArray, "cudaErrorNotMappedAsArray"},
      {cudaErrorNotMappedAsPointer, "cudaErrorNotMappedAsPointer"},
      {cudaErrorECCUncorrectable, "cudaErrorECCUncorrectable"},
      {cudaErrorUnsupportedLimit, "cudaErrorUnsupportedLimit"},
      {cudaErrorDeviceAlreadyInUse, "cudaErrorDeviceAlreadyInUse"},
      {cudaErrorPeerAccessUnsupported, "cudaErrorPeerAccessUnsupported"},
      {cudaErrorInvalidPtx, "cudaErrorInvalidPtx"},
      {cudaErrorInvalidGraphicsContext, "cudaErrorInvalidGraphicsContext"},
      {cudaErrorNvlinkUncorrectable, "cudaErrorNvlinkUncorrectable"},
      {cudaErrorJitCompilerNotFound, "cudaErrorJitCompilerNotFound"},
      {cudaErrorUnsupportedPtxVersion, "cudaErrorUnsupportedPtxVersion"},
      {cudaErrorJitCompilationDisabled, "cudaErrorJitCompilationDisabled"},
      {cudaErrorUnsupportedExecAffinity, "cudaErrorUnsupportedExecAffinity"},
      {cudaErrorUnsupportedDevSideSync, "cudaErrorUnsupportedDevSideSync"},
      {cudaErrorContained, "cudaErrorContained"},
      {cudaErrorInvalidSource, "cudaErrorInvalidSource"},
      {cudaErrorFileNotFound, "cudaErrorFileNotFound"},
      {cudaErrorSharedObjectSymbolNotFound, "cudaErrorSharedObjectSymbolNotFound"},
      {cudaErrorSharedObjectInitFailed, "cudaErrorSharedObjectInitFailed"},
      {cudaErrorOperatingSystem, "cudaErrorOperatingSystem"},
      {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle"},
      {cudaErrorIllegalState, "cudaErrorIllegalState"},
      {cudaErrorLossyQuery, "cudaErrorLossyQuery"},
      {cudaErrorSymbolNotFound, "cudaErrorSymbolNotFound"},
      {cudaErrorNotReady, "cudaErrorNotReady"},
      {cudaErrorIllegalAddress, "cudaErrorIllegalAddress"},
      {cudaErrorLaunchOutOfResources, "cudaErrorLaunchOutOfResources"},
      {cudaErrorLaunchTimeout, "cudaErrorLaunchTimeout"},
      {cudaErrorLaunchIncompatibleTexturing, "cudaErrorLaunchIncompatibleTexturing"},
      {cudaErrorPeerAccessAlreadyEnabled, "cudaErrorPeerAccessAlreadyEnabled"},
      {cudaErrorPeerAccessNotEnabled, "cudaErrorPeerAccessNotEnabled"},
      {cudaErrorSetOnActiveProcess, "cudaErrorSetOnActiveProcess"},
      {cudaErrorContextIsDestroyed, "cudaErrorContextIsDestroyed"},
      {cudaErrorAssert, "cudaErrorAssert"},
      {cudaErrorTooManyPeers, "cudaErrorTooManyPeers"},
      {cudaErrorHostMemoryAlreadyRegistered, "cudaErrorHostMemoryAlreadyRegistered"},
      {cudaErrorHostMemoryNotRegistered, "cudaErrorHostMemoryNotRegistered"},
      {cudaErrorHardwareStackError, "cudaErrorHardwareStackError"},
      {cudaErrorIllegalInstruction, "cudaErrorIllegalInstruction"},
      {cudaErrorMisalignedAddress, "cudaErrorMisalignedAddress"},
      {cudaErrorInvalidAddressSpace, "cudaErrorInvalidAddressSpace"},
      {cudaErrorInvalidPc, "cudaErrorInvalidPc"},
      {cudaErrorLaunchFailure, "cudaErrorLaunchFailure"},
      {cudaErrorCooperativeLaunchTooLarge, "cudaErrorCooperativeLaunchTooLarge"},
      {cudaErrorTensorMemoryLeak, "cudaErrorTensorMemoryLeak"},
      {cudaErrorNotPermitted, "cudaErrorNotPermitted"},
      {cudaErrorNotSupported, "cudaErrorNotSupported"},
      {cudaErrorSystemNotReady, "cudaErrorSystemNotReady"},
      {cudaErrorSystemDriverMismatch, "cudaErrorSystemDriverMismatch"},
      {cudaErrorCompatNotSupportedOnDevice, "cudaErrorCompatNotSupportedOnDevice"},
      {cudaErrorMpsConnectionFailed, "cudaErrorMpsConnectionFailed"},
      {cudaErrorMpsRpcFailure, "cudaErrorMpsRpcFailure"},
      {cudaErrorMpsServerNotReady, "cudaErrorMpsServerNotReady"},
      {cudaErrorMpsMaxClientsReached, "cudaErrorMpsMaxClientsReached"},
      {cudaErrorMpsMaxConnectionsReached, "cudaErrorMpsMaxConnectionsReached"},
      {cudaErrorMpsClientTerminated, "cudaErrorMpsClientTerminated"},
      {cudaErrorCdpNotSupported, "cudaErrorCdpNotSupported"},
      {cudaErrorCdpVersionMismatch, "cudaErrorCdpVersionMismatch"},
      {cudaErrorStreamCaptureUnsupported, "cudaErrorStreamCaptureUnsupported"},
      {cudaErrorStreamCaptureInvalidated, "cudaErrorStreamCaptureInvalidated"},
      {cudaErrorStreamCaptureMerge, "cudaErrorStreamCaptureMerge"},
      {cudaErrorStreamCaptureUnmatched, "cudaErrorStreamCaptureUnmatched"},
      {cudaErrorStreamCaptureUnjoined, "cudaErrorStreamCaptureUnjoined"},
      {cudaErrorStreamCaptureIsolation, "cudaErrorStreamCaptureIsolation"},
      {cudaErrorStreamCaptureImplicit, "cudaErrorStreamCaptureImplicit"},
      {cudaErrorCapturedEvent, "cudaErrorCapturedEvent"},
      {cudaErrorStreamCaptureWrongThread, "cudaErrorStreamCaptureWrongThread"},
      {cudaErrorTimeout, "cudaErrorTimeout"},
      {cudaErrorGraphExecUpdateFailure, "cudaErrorGraphExecUpdateFailure"},
      {cudaErrorExternalDevice, "cudaErrorExternalDevice"},
      {cudaErrorInvalidClusterSize, "cudaErrorInvalidClusterSize"},
      {cudaErrorFunctionNotLoaded, "cudaErrorFunctionNotLoaded"},
      {cudaErrorInvalidResourceType, "cudaErrorInvalidResourceType"},
      {cudaErrorInvalidResourceConfiguration, "cudaErrorInvalidResourceConfiguration"},
      {cudaErrorUnknown, "cudaErrorUnknown"},
  };
  for (const auto& [code, name] : names) {
    if (code == error) return name;
  }
  return nullptr;
}

const char* error_text(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInitializationError:
      return "initialization error";
    case cudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
    case cudaErrorHostMemoryAlreadyRegistered:
      return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered:
      return "pointer does not correspond to a registered memory region";
    case cudaErrorPeerAccessAlreadyEnabled:
      return "peer access is already enabled";
    case cudaErrorPeerAccessNotEnabled:
      return "peer access has not been enabled";
    case cudaErrorNotPermitted:
      return "operation not permitted";
    case cudaErrorNotSupported:
      return "operation not supported";
    case cudaErrorAssert:
      return "device-side assert triggered";
    case cudaErrorUnknown:
      return "unknown error";
    default:
      return nullptr;
  }
}

}  // namespace

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  if (const cudaError_t status = admit(true)) return result(status);
  if (count == nullptr) return result(cudaErrorInvalidValue);
  *count = runtime().visible.load(std::memory_order_relaxed);
  return *count == 0 ? result(cudaErrorNoDevice) : cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (const cudaError_t status = admit()) return result(status);
  if (runtime().visible.load(std::memory_order_relaxed) == 0) return result(cudaErrorNoDevice);
  if (device_at(device) == nullptr) return result(cudaErrorInvalidDevice);
  this_thread().device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (const cudaError_t status = admit(true)) return result(status);
  if (device == nullptr) return result(cudaErrorInvalidValue);
  if (runtime().visible.load(std::memory_order_relaxed) == 0) return result(cudaErrorNoDevice);
  *device = this_thread().device;
  return cudaSuccess;
}

cudaError_t cudaInitDevice(int device, unsigned int deviceFlags, unsigned int flags) {
  if (const cudaError_t status = admit()) return result(status);
  if (deviceFlags != 0 || flags != 0) return result(cudaErrorInvalidValue);
  return result(device_at(device) != nullptr ? cudaSuccess : cudaErrorInvalidDevice);
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (const cudaError_t status = admit()) return result(status);
  if (prop == nullptr) return result(cudaErrorInvalidValue);
  const Device* shown = device_at(device);
  if (shown == nullptr) return result(cudaErrorInvalidDevice);
  *prop = properties_of(*shown);
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (const cudaError_t status = admit()) return result(status);
  if (value == nullptr) return result(cudaErrorInvalidValue);
  const Device* shown = device_at(device);
  if (shown == nullptr) return result(cudaErrorInvalidDevice);
  if (!attribute_of(properties_of(*shown), attr, *value)) return result(cudaErrorInvalidValue);
  return cudaSuccess;
}

cudaError_t cudaSetDeviceFlags(unsigned int flags) {
  if (const cudaError_t status = admit()) return result(status);
  constexpr unsigned known =
      cudaDeviceScheduleMask | cudaDeviceMapHost | cudaDeviceLmemResizeToMax | cudaDeviceSyncMemops;
  if ((flags & ~known) != 0 || (flags & cudaDeviceScheduleMask) == 0x3 ||
      (flags & cudaDeviceScheduleMask) > cudaDeviceScheduleBlockingSync) {
    return result(cudaErrorInvalidValue);
  }
  Device* device = nullptr;
  if (const cudaError_t status = current_device(device)) return result(status);
  device->flags.store(flags, std::memory_order_relaxed);
  return cudaSuccess;
}

cudaError_t cudaGetDeviceFlags(unsigned int* flags) {
  if (const cudaError_t status = admit()) return result(status);
  if (flags == nullptr) return result(cudaErrorInvalidValue);
  Device* device = nullptr;
  if (const cudaError_t status = current_device(device)) return result(status);
  *flags = device->flags.load(std::memory_order_relaxed) | cudaDeviceMapHost;  // always mapped
  return cudaSuccess;
}

cudaError_t cudaDeviceCanAccessPeer(int* canAccessPeer, int device, int peerDevice) {
  if (const cudaError_t status = admit()) return result(status);
  if (canAccessPeer == nullptr) return result(cudaErrorInvalidValue);
  if (device_at(device) == nullptr || device_at(peerDevice) == nullptr) {
    return result(cudaErrorInvalidDevice);
  }
  *canAccessPeer = device != peerDevice ? 1 : 0;  // all simulated devices are peers
  return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peerDevice, unsigned int flags) {
  if (const cudaError_t status = admit()) return result(status);
  if (flags != 0) return result(cudaErrorInvalidValue);
  Device* device = nullptr;
  if (const cudaError_t status = current_device(device)) return result(status);
  if (device_at(peerDevice) == nullptr || peerDevice == device->ordinal) {
    return result(cudaErrorInvalidDevice);
  }
  const std::uint64_t bit = std::uint64_t{1} << peerDevice;
  if ((device->peers_enabled.fetch_or(bit, std::memory_order_relaxed) & bit) != 0) {
    return result(cudaErrorPeerAccessAlreadyEnabled);
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceDisablePeerAccess(int peerDevice) {
  if (const cudaError_t status = admit()) return result(status);
  Device* device = nullptr;
  if (const cudaError_t status = current_device(device)) return result(status);
  if (device_at(peerDevice) == nullptr) return result(cudaErrorInvalidDevice);
  const std::uint64_t bit = std::uint64_t{1} << peerDevice;
  if ((device->peers_enabled.fetch_and(~bit, std::memory_order_relaxed) & bit) == 0) {
    return result(cudaErrorPeerAccessNotEnabled);
  }
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* runtimeVersion) {
  if (runtimeVersion == nullptr) return result(cudaErrorInvalidValue);
  *runtimeVersion = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* driverVersion) {
  if (driverVersion == nullptr) return result(cudaErrorInvalidValue);
  *driverVersion = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  if (const cudaError_t status = admit(true)) return status;
  ThreadState& state = this_thread();
  if (const Device* device = device_at(state.device)) {
    if (const cudaError_t fault = fault_of(*device)) return fault;  // sticky: never cleared
  }
  const cudaError_t last = state.last_error;
  state.last_error = cudaSuccess;
  return last;
}

cudaError_t cudaPeekAtLastError(void) {
  if (const cudaError_t status = admit(true)) return status;
  const ThreadState& state = this_thread();
  if (const Device* device = device_at(state.device)) {
    if (const cudaError_t fault = fault_of(*device)) return fault;
  }
  return state.last_error;
}

const char* cudaGetErrorName(cudaError_t error) {
  const char* name = error_name(error);
  return name != nullptr ? name : "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  if (const char* text = error_text(error)) return text;
  if (error_name(error) != nullptr) return error_name(error);  // rarer codes: their name
  return "unrecognized error code";
}

// ---- cuda_sim/control.h ----

int cuda_sim_device_count(void) {
  return runtime().visible.load(std::memory_order_relaxed);
}

cudaError_t cuda_sim_set_device_count(int count) {
  if (count < 0 || count > max_devices) return cudaErrorInvalidValue;
  runtime().visible.store(count, std::memory_order_relaxed);
  return cudaSuccess;
}

void cuda_sim_set_stress(int enabled, unsigned long long seed) {
  Runtime& rt = runtime();
  rt.stress_seed.store(seed, std::memory_order_relaxed);
  rt.stress.store(enabled != 0, std::memory_order_relaxed);
}

int cuda_sim_stress_enabled(unsigned long long* seed) {
  const Runtime& rt = runtime();
  if (seed != nullptr) *seed = rt.stress_seed.load(std::memory_order_relaxed);
  return rt.stress.load(std::memory_order_relaxed) ? 1 : 0;
}

cudaError_t cuda_sim_inject_fault(int device, cudaError_t error) {
  Device* target = device_at(device);
  if (target == nullptr) return cudaErrorInvalidDevice;
  if (error == cudaSuccess) return cudaErrorInvalidValue;
  target->fault.store(error, std::memory_order_relaxed);
  return cudaSuccess;
}

cudaError_t cuda_sim_clear_fault(int device) {
  Device* target = device_at(device);
  if (target == nullptr) return cudaErrorInvalidDevice;
  target->fault.store(cudaSuccess, std::memory_order_relaxed);
  return cudaSuccess;
}

size_t cuda_sim_device_bytes_outstanding(int device) {
  const Device* target = device_at(device);
  return target == nullptr ? 0 : target->device_bytes.load(std::memory_order_relaxed);
}

size_t cuda_sim_pinned_bytes_outstanding(void) {
  return runtime().pinned_bytes.load(std::memory_order_relaxed);
}

unsigned long long cuda_sim_tasks_run(int device) {
  const Device* target = device_at(device);
  return target == nullptr ? 0 : target->tasks_run.load(std::memory_order_relaxed);
}

int cuda_sim_worker_threads(void) {
  return runtime().workers.load(std::memory_order_relaxed);
}

int cuda_sim_in_stream_work(void) {
  return this_thread().worker_of != nullptr ? 1 : 0;
}

}  // extern "C"
