/* attnkit native kernels: what this library was built with, as attnkit.h declares it. The
 * Python loader compares these tables with its own reading of attnkit.h at load (the
 * constants, every field's offset and size, the error table), so a library built from
 * another header, or a compiler that lays a struct out otherwise, is refused with a message
 * naming the difference rather than misread.
 */
#include "attnkit.h"

int attnkit_native_abi(void) { return AK_ABI; }

typedef struct {
    const char *name;
    int64_t value;
} ak_abi_constant;

#define AK_CONSTANT_ENTRY_(name, value, doc) {#name, name},
static const ak_abi_constant constants[] = {AK_CONSTANTS(AK_CONSTANT_ENTRY_)};

const char *attnkit_abi_constant(int i, int64_t *value) {
    if (i < 0 || i >= (int)(sizeof constants / sizeof constants[0])) return NULL;
    if (value) *value = constants[i].value;
    return constants[i].name;
}

typedef struct {
    const char *name;
    int64_t offset, size;
} ak_abi_field;

/* one struct's entries: the struct itself, then every field in order */
#define AK_LAYOUT_FIELD_(type, name) \
    {AK_LAYOUT_NAME_ "." #name, offsetof(AK_LAYOUT_T_, name), sizeof(((AK_LAYOUT_T_ *)0)->name)},
#define AK_LAYOUT_ARRAY_(type, name, count) AK_LAYOUT_FIELD_(type, name)
#define AK_LAYOUT_(s) \
    {AK_LAYOUT_NAME_, 0, sizeof(s)}, AK_FIELDS_##s(AK_LAYOUT_FIELD_, AK_LAYOUT_ARRAY_)

static const ak_abi_field fields[] = {
#define AK_LAYOUT_T_ ak_flash_args
#define AK_LAYOUT_NAME_ "ak_flash_args"
    AK_LAYOUT_(ak_flash_args)
#undef AK_LAYOUT_T_
#undef AK_LAYOUT_NAME_
#define AK_LAYOUT_T_ ak_flash_grads
#define AK_LAYOUT_NAME_ "ak_flash_grads"
    AK_LAYOUT_(ak_flash_grads)
#undef AK_LAYOUT_T_
#undef AK_LAYOUT_NAME_
};

const char *attnkit_abi_field(int i, int64_t *offset, int64_t *size) {
    if (i < 0 || i >= (int)(sizeof fields / sizeof fields[0])) return NULL;
    if (offset) *offset = fields[i].offset;
    if (size) *size = fields[i].size;
    return fields[i].name;
}

const char *attnkit_error_name(int code) {
    switch (code) {
#define AK_ERROR_NAME_(name, value, message) \
    case name: return #name;
        AK_ERRORS(AK_ERROR_NAME_)
    default: return NULL;
    }
}

const char *attnkit_error_message(int code) {
    switch (code) {
#define AK_ERROR_MESSAGE_(name, value, message) \
    case name: return message;
        AK_ERRORS(AK_ERROR_MESSAGE_)
    default: return NULL;
    }
}
