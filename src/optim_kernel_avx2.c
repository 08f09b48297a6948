/* The optimizer element loops for the avx2 instruction set (flags in CMakeLists.txt). */
#define SPW_OPTIM_SUFFIX avx2
#include "optim_kernel.h"
