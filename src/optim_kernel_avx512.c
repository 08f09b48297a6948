/* The optimizer element loops for the avx512 instruction set (flags in CMakeLists.txt). */
#define SPW_OPTIM_SUFFIX avx512
#include "optim_kernel.h"
