/* A stand-in CUDA driver library: present, but with no device. cuInit returns
 * CUDA_ERROR_NO_DEVICE (100), as a real driver does on a machine without a GPU.
 * Built as libcuda.so.1 by the tests to exercise "driver present, no GPU". */
typedef int CUresult;
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100

CUresult cuInit(unsigned int flags) {
    (void)flags;
    return CUDA_ERROR_NO_DEVICE;
}
CUresult cuDriverGetVersion(int *version) {
    if (version) *version = 12040;
    return 0;
}
CUresult cuDeviceGetCount(int *count) {
    if (count) *count = 0;
    return CUDA_ERROR_NOT_INITIALIZED;
}
CUresult cuGetErrorName(CUresult error, const char **name) {
    if (name) *name = error == CUDA_ERROR_NO_DEVICE ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN";
    return 0;
}
CUresult cuGetErrorString(CUresult error, const char **text) {
    if (text) *text = error == CUDA_ERROR_NO_DEVICE ? "no CUDA-capable device is detected" : "unknown error";
    return 0;
}
