/* The optimizer element loops for the generic instruction set (flags in CMakeLists.txt). */
#define SPW_OPTIM_SUFFIX generic
#include "optim_kernel.h"
