/* placeholder: being written */
typedef int spw__placeholder_;
