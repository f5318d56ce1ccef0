/*
 * A fake libnvidia-ml.so.1 for tests: the real, unmodified pynvml loads it through LD_LIBRARY_PATH and
 * sees the GPUs described by the scenario file named in $FAKEGPU_SCENARIO (shared/contracts/gpu-scenario.md).
 *
 * It never parses YAML. On first use, and whenever the file's mtime/size/inode change, it runs
 * `FAKEGPU_PYTHON FAKEGPU_FLATTEN <scenario>` (both baked in with -D at build time) and reads the
 * validated scenario as flat key=value lines: one block per GPU state, the base state first, then the
 * complete state after each timeline entry. A GPU shows the latest block whose after_s has passed,
 * counted from this process's first NVML or nvidia-smi call (a clock file shared with the fake nvidia-smi).
 *
 * Build: gcc -shared -fPIC -O2 -Wl,-soname,libnvidia-ml.so.1 -DFAKEGPU_PYTHON=... -DFAKEGPU_FLATTEN=...
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef FAKEGPU_PYTHON
#error "build with -DFAKEGPU_PYTHON=\"/path/to/python\""
#endif
#ifndef FAKEGPU_FLATTEN
#error "build with -DFAKEGPU_FLATTEN=\"/path/to/flatten.py\""
#endif

extern char **environ;

#define MAX_GPUS 64
#define MAX_LINKS 36 /* NVML_NVLINK_MAX_LINKS */
#define MAX_PROCS 128
#define MAX_BLOCKS 1024
#define HELPER_TIMEOUT_MS 20000
#define MIB 1048576ULL
#define NVML_VALUE_NOT_AVAILABLE (~0ULL) /* nvml.h: a value the driver cannot give */

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};
typedef int nvmlReturn_t;

struct fake_link {
    int active;
    unsigned long long crc_errors, replay_errors, recovery_errors;
};

struct fake_proc {
    unsigned pid;
    unsigned long long used_memory_mib;
};

struct fake_gpu {
    char name[96], uuid[96], pci_bus_id[32];
    int lost, persistence_mode;
    unsigned long long temperature_c, sm, sm_max, mem, mem_max, clocks_event_reasons;
    double power_draw, power_limit, power_default_limit;
    unsigned long long memory_total, memory_used, util_gpu, util_memory;
    int mig_supported, mig_current, mig_pending;
    int ecc_supported, ecc_enabled;
    unsigned long long ecc_vol_corr, ecc_vol_unc, ecc_agg_corr, ecc_agg_unc;
    int rows_supported, rows_pending, rows_failure;
    unsigned long long rows_corr, rows_unc;
    int pages_supported, pages_pending;
    unsigned long long pages_sbe, pages_dbe;
    unsigned long long pcie_gen, pcie_gen_max, pcie_width, pcie_width_max, pcie_replay;
    unsigned long long pci_device_id, pci_subsystem_id;
    int link_count, proc_count;
    struct fake_link links[MAX_LINKS];
    struct fake_proc procs[MAX_PROCS];
};

/* The device handle pynvml passes around is a pointer to one of these. */
struct nvmlDevice_st {
    unsigned index;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define NVML_MEMORY_V2 0x02000028u

typedef struct {
    unsigned gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned pid;
    unsigned long long usedGpuMemory;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_v2_t; /* the v3 layout is the same */

/* A parsed scenario: global keys plus one complete GPU state per block. */
struct model {
    int driver_loaded, library_present, gpu_count;
    char driver_version[80];
    unsigned long long cuda_version;
    int block_count;
    int block_gpu[MAX_BLOCKS];
    double block_after[MAX_BLOCKS];
    struct fake_gpu *blocks; /* block_count entries */
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct model current;
static int model_loaded;
static struct stat model_stat;
static int init_count;
static double clock_start = -1.0;
static struct nvmlDevice_st handles[MAX_GPUS];

/* ---------------------------------------------------------------- parsing */

enum kind { K_STR, K_FLAG, K_ULL, K_DBL };
struct field {
    const char *key;
    enum kind kind;
    size_t offset, size;
};
#define F(key, kind, member) {key, kind, offsetof(struct fake_gpu, member), sizeof(((struct fake_gpu *)0)->member)}
static const struct field fields[] = {
    F("name", K_STR, name),
    F("uuid", K_STR, uuid),
    F("pci_bus_id", K_STR, pci_bus_id),
    F("lost", K_FLAG, lost),
    F("persistence_mode", K_FLAG, persistence_mode),
    F("temperature_c", K_ULL, temperature_c),
    F("clocks_mhz.sm", K_ULL, sm),
    F("clocks_mhz.sm_max", K_ULL, sm_max),
    F("clocks_mhz.mem", K_ULL, mem),
    F("clocks_mhz.mem_max", K_ULL, mem_max),
    F("clocks_event_reasons", K_ULL, clocks_event_reasons),
    F("power_w.draw", K_DBL, power_draw),
    F("power_w.limit", K_DBL, power_limit),
    F("power_w.default_limit", K_DBL, power_default_limit),
    F("memory_mib.total", K_ULL, memory_total),
    F("memory_mib.used", K_ULL, memory_used),
    F("utilization_pct.gpu", K_ULL, util_gpu),
    F("utilization_pct.memory", K_ULL, util_memory),
    F("mig_mode.current", K_FLAG, mig_current),
    F("mig_mode.pending", K_FLAG, mig_pending),
    F("ecc.enabled", K_FLAG, ecc_enabled),
    F("ecc.volatile.corrected", K_ULL, ecc_vol_corr),
    F("ecc.volatile.uncorrected", K_ULL, ecc_vol_unc),
    F("ecc.aggregate.corrected", K_ULL, ecc_agg_corr),
    F("ecc.aggregate.uncorrected", K_ULL, ecc_agg_unc),
    F("remapped_rows.corrected", K_ULL, rows_corr),
    F("remapped_rows.uncorrected", K_ULL, rows_unc),
    F("remapped_rows.pending", K_FLAG, rows_pending),
    F("remapped_rows.failure", K_FLAG, rows_failure),
    F("retired_pages.single_bit", K_ULL, pages_sbe),
    F("retired_pages.double_bit", K_ULL, pages_dbe),
    F("retired_pages.pending", K_FLAG, pages_pending),
    F("pcie.gen", K_ULL, pcie_gen),
    F("pcie.gen_max", K_ULL, pcie_gen_max),
    F("pcie.width", K_ULL, pcie_width),
    F("pcie.width_max", K_ULL, pcie_width_max),
    F("pcie.replay_counter", K_ULL, pcie_replay),
    F("pci_device_id", K_ULL, pci_device_id),
    F("pci_subsystem_id", K_ULL, pci_subsystem_id),
    F("nvlinks.count", K_FLAG, link_count),
    F("processes.count", K_FLAG, proc_count),
};

static void set_gpu_key(struct fake_gpu *gpu, const char *key, const char *value) {
    unsigned index;
    int used = 0;
    if (strcmp(value, "not_supported") == 0) {
        if (strcmp(key, "ecc") == 0) gpu->ecc_supported = 0;
        if (strcmp(key, "remapped_rows") == 0) gpu->rows_supported = 0;
        if (strcmp(key, "retired_pages") == 0) gpu->pages_supported = 0;
        if (strcmp(key, "mig_mode") == 0) gpu->mig_supported = 0;
        return;
    }
    if (sscanf(key, "nvlinks.%u.%n", &index, &used) == 1 && used > 0 && index < MAX_LINKS) {
        const char *leaf = key + used;
        struct fake_link *link = &gpu->links[index];
        unsigned long long number = strtoull(value, NULL, 10);
        if (strcmp(leaf, "active") == 0) link->active = (int)number;
        if (strcmp(leaf, "crc_errors") == 0) link->crc_errors = number;
        if (strcmp(leaf, "replay_errors") == 0) link->replay_errors = number;
        if (strcmp(leaf, "recovery_errors") == 0) link->recovery_errors = number;
        return;
    }
    if (sscanf(key, "processes.%u.%n", &index, &used) == 1 && used > 0 && index < MAX_PROCS) {
        const char *leaf = key + used;
        if (strcmp(leaf, "pid") == 0) gpu->procs[index].pid = (unsigned)strtoul(value, NULL, 10);
        if (strcmp(leaf, "used_memory_mib") == 0)
            gpu->procs[index].used_memory_mib =
                strcmp(value, "not_available") == 0 ? NVML_VALUE_NOT_AVAILABLE : strtoull(value, NULL, 10);
        return;
    }
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
        const struct field *f = &fields[i];
        char *target = (char *)gpu + f->offset;
        if (strcmp(f->key, key) != 0) continue;
        if (f->kind == K_STR) {
            snprintf(target, f->size, "%s", value);
        } else if (f->kind == K_FLAG) {
            *(int *)target = atoi(value);
        } else if (f->kind == K_ULL) {
            *(unsigned long long *)target = strtoull(value, NULL, 10);
        } else {
            *(double *)target = strtod(value, NULL);
        }
        return;
    }
}

static void reset_gpu(struct fake_gpu *gpu) {
    memset(gpu, 0, sizeof(*gpu));
    gpu->ecc_supported = gpu->rows_supported = gpu->pages_supported = gpu->mig_supported = 1;
}

/* Parse the helper's output into `out`; 0 on success (the output must end with @end). */
static int parse_model(char *text, struct model *out) {
    int complete = 0;
    struct fake_gpu *gpu = NULL;
    memset(out, 0, sizeof(*out));
    out->blocks = calloc(MAX_BLOCKS, sizeof(struct fake_gpu));
    if (!out->blocks) return -1;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        char *eq;
        if (strncmp(line, "@gpu ", 5) == 0) {
            int index;
            double after;
            if (out->block_count >= MAX_BLOCKS || sscanf(line + 5, "%d %lf", &index, &after) != 2) return -1;
            if (index < 0 || index >= MAX_GPUS) return -1;
            out->block_gpu[out->block_count] = index;
            out->block_after[out->block_count] = after;
            gpu = &out->blocks[out->block_count++];
            reset_gpu(gpu);
            continue;
        }
        if (strcmp(line, "@end") == 0) {
            complete = 1;
            break;
        }
        eq = strchr(line, '=');
        if (!eq) continue;
        *eq = '\0';
        if (gpu) {
            set_gpu_key(gpu, line, eq + 1);
        } else if (strcmp(line, "driver.loaded") == 0) {
            out->driver_loaded = atoi(eq + 1);
        } else if (strcmp(line, "driver.library") == 0) {
            out->library_present = strcmp(eq + 1, "present") == 0;
        } else if (strcmp(line, "driver.version") == 0) {
            snprintf(out->driver_version, sizeof(out->driver_version), "%s", eq + 1);
        } else if (strcmp(line, "driver.cuda_version") == 0) {
            out->cuda_version = strtoull(eq + 1, NULL, 10);
        } else if (strcmp(line, "gpu_count") == 0) {
            out->gpu_count = atoi(eq + 1);
        }
    }
    if (out->gpu_count > MAX_GPUS) out->gpu_count = MAX_GPUS;
    return complete ? 0 : -1;
}

/* ------------------------------------------------------------ the helper */

/* Run the flatten helper with a deadline; returns its stdout (malloc'd) or NULL. */
static char *run_helper(const char *scenario) {
    int pipe_fds[2];
    pid_t pid;
    char *argv[] = {(char *)FAKEGPU_PYTHON, (char *)"-E", (char *)"-s", (char *)FAKEGPU_FLATTEN, (char *)scenario, NULL};
    posix_spawn_file_actions_t actions;
    size_t size = 0, capacity = 65536;
    char *buffer = malloc(capacity);
    struct timespec started, now;
    int status = 0, ok = 1;

    if (!buffer || pipe2(pipe_fds, O_CLOEXEC) != 0) {
        free(buffer);
        return NULL;
    }
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
    posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    if (posix_spawn(&pid, FAKEGPU_PYTHON, &actions, NULL, argv, environ) != 0) {
        posix_spawn_file_actions_destroy(&actions);
        close(pipe_fds[0]);
        close(pipe_fds[1]);
        free(buffer);
        return NULL;
    }
    posix_spawn_file_actions_destroy(&actions);
    close(pipe_fds[1]);
    clock_gettime(CLOCK_MONOTONIC, &started);
    for (;;) {
        struct pollfd pfd = {pipe_fds[0], POLLIN, 0};
        long waited_ms;
        ssize_t got;
        clock_gettime(CLOCK_MONOTONIC, &now);
        waited_ms = (now.tv_sec - started.tv_sec) * 1000 + (now.tv_nsec - started.tv_nsec) / 1000000;
        if (waited_ms >= HELPER_TIMEOUT_MS) {
            kill(pid, SIGKILL);
            ok = 0;
            break;
        }
        if (poll(&pfd, 1, (int)(HELPER_TIMEOUT_MS - waited_ms)) <= 0) continue;
        if (size + 4096 + 1 > capacity) {
            char *bigger = realloc(buffer, capacity * 2);
            if (!bigger) {
                kill(pid, SIGKILL);
                ok = 0;
                break;
            }
            buffer = bigger;
            capacity *= 2;
        }
        got = read(pipe_fds[0], buffer + size, capacity - size - 1);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;
        size += (size_t)got;
    }
    close(pipe_fds[0]);
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (!ok || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        free(buffer);
        return NULL;
    }
    buffer[size] = '\0';
    return buffer;
}

/* Load or reload the scenario when its file changed; caller holds `lock`. 0 when a model is available. */
static int refresh_locked(void) {
    const char *path = getenv("FAKEGPU_SCENARIO");
    struct stat st;
    struct model fresh;
    char *text;
    if (!path || stat(path, &st) != 0) return model_loaded ? 0 : -1;
    if (model_loaded && st.st_mtim.tv_sec == model_stat.st_mtim.tv_sec &&
        st.st_mtim.tv_nsec == model_stat.st_mtim.tv_nsec && st.st_size == model_stat.st_size &&
        st.st_ino == model_stat.st_ino)
        return 0;
    text = run_helper(path);
    if (!text) return model_loaded ? 0 : -1; /* keep the last good state (e.g. a file half-written) */
    if (parse_model(text, &fresh) != 0) {
        free(fresh.blocks);
        free(text);
        return model_loaded ? 0 : -1;
    }
    free(text);
    free(current.blocks);
    current = fresh;
    model_stat = st;
    model_loaded = 1;
    return 0;
}

/* ------------------------------------------------------------- the clock */

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Field 22 of /proc/self/stat: this process's start time in clock ticks (pid + start time = one process). */
static unsigned long long own_start_ticks(void) {
    char text[1024];
    unsigned long long ticks = 0;
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    ssize_t got;
    char *cursor;
    if (fd < 0) return 0;
    got = read(fd, text, sizeof(text) - 1);
    close(fd);
    if (got <= 0) return 0;
    text[got] = '\0';
    cursor = strrchr(text, ')');
    if (!cursor) return 0;
    /* after ") " come fields 3..; the start time is field 22, i.e. the 20th after the name */
    for (int field = 3; field < 22 && cursor; field++) cursor = strchr(cursor + 1, ' ');
    if (cursor) ticks = strtoull(cursor + 1, NULL, 10);
    return ticks;
}

static int read_clock_file(const char *path, double *start) {
    char text[64];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t got;
    if (fd < 0) return -1;
    got = read(fd, text, sizeof(text) - 1);
    close(fd);
    if (got <= 0) return -1;
    text[got] = '\0';
    *start = strtod(text, NULL);
    return *start > 0 ? 0 : -1;
}

/* The caller's time zero: shared with nvidia-smi through $FAKEGPU_STATE_DIR/clock-<pid>-<start ticks>. */
static double clock_zero(void) {
    char dir[512], path[640], temp[700], text[64];
    const char *env_dir = getenv("FAKEGPU_STATE_DIR");
    double start = wall_now();
    int fd;
    if (env_dir && *env_dir)
        snprintf(dir, sizeof(dir), "%s", env_dir);
    else
        snprintf(dir, sizeof(dir), "/tmp/fakegpu-%u", (unsigned)getuid());
    mkdir(dir, 0700);
    snprintf(path, sizeof(path), "%s/clock-%d-%llu", dir, (int)getpid(), own_start_ticks());
    if (read_clock_file(path, &start) == 0) return start;
    snprintf(temp, sizeof(temp), "%s.tmp-%d", path, (int)getpid());
    fd = open(temp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return start;
    snprintf(text, sizeof(text), "%.6f\n", start);
    if (write(fd, text, strlen(text)) < 0) start = wall_now();
    close(fd);
    if (link(temp, path) != 0) read_clock_file(path, &start); /* another caller was first: use its zero */
    unlink(temp);
    return start;
}

static double elapsed_locked(void) {
    if (clock_start < 0) clock_start = clock_zero();
    return wall_now() - clock_start;
}

/* ------------------------------------------------------- common checks */

static int check_init_locked(void) {
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    refresh_locked();
    return NVML_SUCCESS;
}

/* Copy the GPU behind `device`, as it is now, into `out`. */
static nvmlReturn_t device_state(nvmlDevice_t device, const void *result, struct fake_gpu *out) {
    int rc, chosen = -1;
    double elapsed;
    pthread_mutex_lock(&lock);
    rc = check_init_locked();
    if (rc == NVML_SUCCESS && (device < handles || device >= handles + MAX_GPUS || !result ||
                               (int)device->index >= current.gpu_count))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        elapsed = elapsed_locked();
        for (int b = 0; b < current.block_count; b++)
            if (current.block_gpu[b] == (int)device->index && current.block_after[b] <= elapsed) chosen = b;
        if (chosen < 0)
            rc = NVML_ERROR_UNKNOWN;
        else
            *out = current.blocks[chosen];
    }
    pthread_mutex_unlock(&lock);
    if (rc == NVML_SUCCESS && out->lost) rc = NVML_ERROR_GPU_IS_LOST;
    return rc;
}

#define DEVICE_STATE(device, result)                              \
    struct fake_gpu gpu;                                          \
    nvmlReturn_t state_rc = device_state(device, result, &gpu);   \
    if (state_rc != NVML_SUCCESS) return state_rc

static nvmlReturn_t copy_string(char *target, unsigned length, const char *value) {
    if (!target) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(target, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

/* --------------------------------------------------------- init / system */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    nvmlReturn_t rc = NVML_SUCCESS;
    (void)flags;
    pthread_mutex_lock(&lock);
    if (refresh_locked() != 0) {
        fprintf(stderr, "fakenvml: cannot load the scenario named by FAKEGPU_SCENARIO\n");
        rc = NVML_ERROR_UNKNOWN;
    } else if (!current.library_present) {
        rc = NVML_ERROR_LIBRARY_NOT_FOUND;
    } else if (!current.driver_loaded) {
        rc = NVML_ERROR_DRIVER_NOT_LOADED;
    } else {
        init_count++;
        elapsed_locked();
        for (unsigned i = 0; i < MAX_GPUS; i++) handles[i].index = i;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&lock);
    if (init_count <= 0)
        rc = NVML_ERROR_UNINITIALIZED;
    else
        init_count--;
    pthread_mutex_unlock(&lock);
    return rc;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt request issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 25: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t system_string(char *target, unsigned length, int nvml_version) {
    char text[128];
    nvmlReturn_t rc;
    pthread_mutex_lock(&lock);
    rc = check_init_locked();
    if (rc == NVML_SUCCESS) {
        if (nvml_version)
            snprintf(text, sizeof(text), "%llu.%s", current.cuda_version / 1000, current.driver_version);
        else
            snprintf(text, sizeof(text), "%s", current.driver_version);
        rc = copy_string(target, length, text);
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned length) { return system_string(version, length, 0); }
nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned length) { return system_string(version, length, 1); }

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    nvmlReturn_t rc;
    pthread_mutex_lock(&lock);
    rc = check_init_locked();
    if (rc == NVML_SUCCESS && !version) rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) *version = (int)current.cuda_version;
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) { return nvmlSystemGetCudaDriverVersion(version); }

/* ------------------------------------------------------------- handles */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *count) {
    nvmlReturn_t rc;
    pthread_mutex_lock(&lock);
    rc = check_init_locked();
    if (rc == NVML_SUCCESS && !count) rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) *count = (unsigned)current.gpu_count;
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned *count) { return nvmlDeviceGetCount_v2(count); }

/* A lost GPU still has a handle: the contract makes every per-device query fail, not the lookup. */
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, nvmlDevice_t *device) {
    nvmlReturn_t rc;
    pthread_mutex_lock(&lock);
    rc = check_init_locked();
    if (rc == NVML_SUCCESS && (!device || (int)index >= current.gpu_count)) rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) *device = &handles[index];
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

/* "0000:18:00.0" and "00000000:18:00.0" name the same device. */
static int same_bus_id(const char *a, const char *b) {
    unsigned domain_a, bus_a, dev_a, fn_a, domain_b, bus_b, dev_b, fn_b;
    if (sscanf(a, "%x:%x:%x.%x", &domain_a, &bus_a, &dev_a, &fn_a) != 4) return 0;
    if (sscanf(b, "%x:%x:%x.%x", &domain_b, &bus_b, &dev_b, &fn_b) != 4) return 0;
    return domain_a == domain_b && bus_a == bus_b && dev_a == dev_b && fn_a == fn_b;
}

static nvmlReturn_t find_device(const char *wanted, int by_uuid, nvmlDevice_t *device) {
    nvmlReturn_t rc;
    pthread_mutex_lock(&lock);
    rc = check_init_locked();
    if (rc == NVML_SUCCESS && (!wanted || !device)) rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        rc = NVML_ERROR_NOT_FOUND;
        for (int b = 0; b < current.block_count; b++) {
            const struct fake_gpu *gpu = &current.blocks[b];
            int match = by_uuid ? strcmp(gpu->uuid, wanted) == 0 : same_bus_id(gpu->pci_bus_id, wanted);
            if (match && current.block_after[b] < 0) {
                *device = &handles[current.block_gpu[b]];
                rc = NVML_SUCCESS;
                break;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) { return find_device(uuid, 1, device); }
nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus_id, nvmlDevice_t *device) {
    return find_device(bus_id, 0, device);
}
nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *bus_id, nvmlDevice_t *device) {
    return find_device(bus_id, 0, device);
}

/* ------------------------------------------------------------ identity */

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned *index) {
    DEVICE_STATE(device, index);
    *index = device->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned *minor) {
    DEVICE_STATE(device, minor);
    *minor = device->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned length) {
    DEVICE_STATE(device, name);
    return copy_string(name, length, gpu.name);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned length) {
    DEVICE_STATE(device, uuid);
    return copy_string(uuid, length, gpu.uuid);
}

static nvmlReturn_t fill_pci(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    unsigned domain = 0, bus = 0, dev = 0, function = 0;
    DEVICE_STATE(device, pci);
    memset(pci, 0, sizeof(*pci));
    sscanf(gpu.pci_bus_id, "%x:%x:%x.%x", &domain, &bus, &dev, &function);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = (unsigned)gpu.pci_device_id;
    pci->pciSubSystemId = (unsigned)gpu.pci_subsystem_id;
    snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.%X", domain & 0xFFFF, bus, dev, function);
    snprintf(pci->busId, sizeof(pci->busId), "%08X:%02X:%02X.%X", domain, bus, dev, function);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) { return fill_pci(device, pci); }
nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) { return fill_pci(device, pci); }

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode) {
    DEVICE_STATE(device, mode);
    *mode = gpu.persistence_mode ? 1 : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned *current_mode, unsigned *pending_mode) {
    DEVICE_STATE(device, current_mode);
    if (!pending_mode) return NVML_ERROR_INVALID_ARGUMENT;
    if (!gpu.mig_supported) return NVML_ERROR_NOT_SUPPORTED;
    *current_mode = (unsigned)gpu.mig_current;
    *pending_mode = (unsigned)gpu.mig_pending;
    return NVML_SUCCESS;
}

/* ---------------------------------------------- thermal, clocks, power */

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned *temperature) {
    DEVICE_STATE(device, temperature);
    if (sensor != 0) return NVML_ERROR_INVALID_ARGUMENT; /* NVML_TEMPERATURE_GPU is the only sensor */
    *temperature = (unsigned)gpu.temperature_c;
    return NVML_SUCCESS;
}

static nvmlReturn_t clock_of(const struct fake_gpu *gpu, int type, int max, unsigned *clock) {
    switch (type) {
    case 0: /* graphics */
    case 1: /* SM */
        *clock = (unsigned)(max ? gpu->sm_max : gpu->sm);
        return NVML_SUCCESS;
    case 2: /* memory */
        *clock = (unsigned)(max ? gpu->mem_max : gpu->mem);
        return NVML_SUCCESS;
    case 3: /* video: not modelled */
        return NVML_ERROR_NOT_SUPPORTED;
    default:
        return NVML_ERROR_INVALID_ARGUMENT;
    }
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type, unsigned *clock) {
    DEVICE_STATE(device, clock);
    return clock_of(&gpu, type, 0, clock);
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t device, int type, unsigned *clock) {
    DEVICE_STATE(device, clock);
    return clock_of(&gpu, type, 1, clock);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons) {
    DEVICE_STATE(device, reasons);
    *reasons = gpu.clocks_event_reasons;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons) {
    return nvmlDeviceGetCurrentClocksEventReasons(device, reasons);
}

nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t device, int *state) {
    DEVICE_STATE(device, state);
    *state = 0; /* P0: a loaded or idle datacenter GPU under persistence mode */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerState(nvmlDevice_t device, int *state) {
    return nvmlDeviceGetPerformanceState(device, state);
}

static unsigned milliwatts(double watts) { return (unsigned)(watts * 1000.0 + 0.5); }

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned *power) {
    DEVICE_STATE(device, power);
    *power = milliwatts(gpu.power_draw);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned *limit) {
    DEVICE_STATE(device, limit);
    *limit = milliwatts(gpu.power_limit);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned *limit) {
    return nvmlDeviceGetEnforcedPowerLimit(device, limit);
}

nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t device, unsigned *limit) {
    DEVICE_STATE(device, limit);
    *limit = milliwatts(gpu.power_default_limit);
    return NVML_SUCCESS;
}

/* ---------------------------------------------------- memory and usage */

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    DEVICE_STATE(device, memory);
    memory->total = gpu.memory_total * MIB;
    memory->used = gpu.memory_used * MIB;
    memory->free = memory->total > memory->used ? memory->total - memory->used : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    DEVICE_STATE(device, memory);
    if (memory->version != NVML_MEMORY_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = gpu.memory_total * MIB;
    memory->reserved = 0;
    memory->used = gpu.memory_used * MIB;
    memory->free = memory->total > memory->used ? memory->total - memory->used : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    DEVICE_STATE(device, utilization);
    if (gpu.mig_supported && gpu.mig_current) return NVML_ERROR_NOT_SUPPORTED; /* per-instance only under MIG */
    utilization->gpu = (unsigned)gpu.util_gpu;
    utilization->memory = (unsigned)gpu.util_memory;
    return NVML_SUCCESS;
}

/* Bytes, or NVML_VALUE_NOT_AVAILABLE as the driver reports it (Windows WDDM); pynvml reads that as None. */
static unsigned long long process_memory(unsigned long long mib) {
    return mib == NVML_VALUE_NOT_AVAILABLE ? NVML_VALUE_NOT_AVAILABLE : mib * MIB;
}

/* Count-then-fill, as NVML does: a NULL or short buffer gets the count and INSUFFICIENT_SIZE. */
static nvmlReturn_t list_processes(nvmlDevice_t device, unsigned *count, void *infos, int layout_v1, int graphics) {
    DEVICE_STATE(device, count);
    unsigned wanted = graphics ? 0 : (unsigned)gpu.proc_count;
    if (wanted == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (!infos || *count < wanted) {
        *count = wanted;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned i = 0; i < wanted; i++) {
        if (layout_v1) {
            nvmlProcessInfo_v1_t *info = (nvmlProcessInfo_v1_t *)infos + i;
            info->pid = gpu.procs[i].pid;
            info->usedGpuMemory = process_memory(gpu.procs[i].used_memory_mib);
        } else {
            nvmlProcessInfo_v2_t *info = (nvmlProcessInfo_v2_t *)infos + i;
            info->pid = gpu.procs[i].pid;
            info->usedGpuMemory = process_memory(gpu.procs[i].used_memory_mib);
            info->gpuInstanceId = info->computeInstanceId = 0xFFFFFFFFu; /* not a MIG instance */
        }
    }
    *count = wanted;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *n, void *p) {
    return list_processes(d, n, p, 0, 0);
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned *n, void *p) {
    return list_processes(d, n, p, 0, 0);
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned *n, void *p) {
    return list_processes(d, n, p, 1, 0);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned *n, void *p) {
    return list_processes(d, n, p, 0, 1);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned *n, void *p) {
    return list_processes(d, n, p, 0, 1);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t d, unsigned *n, void *p) {
    return list_processes(d, n, p, 1, 1);
}

/* --------------------------------------------------- ECC and retirement */

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, int *current_mode, int *pending_mode) {
    DEVICE_STATE(device, current_mode);
    if (!pending_mode) return NVML_ERROR_INVALID_ARGUMENT;
    if (!gpu.ecc_supported) return NVML_ERROR_NOT_SUPPORTED;
    *current_mode = *pending_mode = gpu.ecc_enabled ? 1 : 0;
    return NVML_SUCCESS;
}

static nvmlReturn_t ecc_total(const struct fake_gpu *gpu, int error_type, int counter_type, unsigned long long *count) {
    if (!gpu->ecc_supported) return NVML_ERROR_NOT_SUPPORTED;
    if (error_type < 0 || error_type > 1 || counter_type < 0 || counter_type > 1) return NVML_ERROR_INVALID_ARGUMENT;
    if (counter_type == 0)
        *count = error_type == 0 ? gpu->ecc_vol_corr : gpu->ecc_vol_unc;
    else
        *count = error_type == 0 ? gpu->ecc_agg_corr : gpu->ecc_agg_unc;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int error_type, int counter_type,
                                         unsigned long long *count) {
    DEVICE_STATE(device, count);
    return ecc_total(&gpu, error_type, counter_type, count);
}

/* The scenario counts DRAM (device memory) errors; SRAM reads 0, other locations are not modelled. */
nvmlReturn_t nvmlDeviceGetMemoryErrorCounter(nvmlDevice_t device, int error_type, int counter_type, int location,
                                             unsigned long long *count) {
    DEVICE_STATE(device, count);
    if (location == 2) return ecc_total(&gpu, error_type, counter_type, count);
    if (location == 7) {
        nvmlReturn_t rc = ecc_total(&gpu, error_type, counter_type, count);
        if (rc == NVML_SUCCESS) *count = 0;
        return rc;
    }
    return location >= 0 && location < 8 ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned *corrected, unsigned *uncorrected,
                                       unsigned *pending, unsigned *failure) {
    DEVICE_STATE(device, corrected);
    if (!uncorrected || !pending || !failure) return NVML_ERROR_INVALID_ARGUMENT;
    if (!gpu.rows_supported) return NVML_ERROR_NOT_SUPPORTED;
    *corrected = (unsigned)gpu.rows_corr;
    *uncorrected = (unsigned)gpu.rows_unc;
    *pending = (unsigned)gpu.rows_pending;
    *failure = (unsigned)gpu.rows_failure;
    return NVML_SUCCESS;
}

static nvmlReturn_t retired_pages(nvmlDevice_t device, int cause, unsigned *count, unsigned long long *addresses,
                                  unsigned long long *timestamps) {
    DEVICE_STATE(device, count);
    unsigned long long wanted;
    if (!gpu.pages_supported) return NVML_ERROR_NOT_SUPPORTED;
    if (cause < 0 || cause > 1) return NVML_ERROR_INVALID_ARGUMENT;
    wanted = cause == 0 ? gpu.pages_sbe : gpu.pages_dbe;
    if (wanted == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (!addresses || *count < wanted) {
        *count = (unsigned)wanted;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned long long i = 0; i < wanted; i++) {
        addresses[i] = 0x100000ULL * (unsigned long long)(cause + 1) + 0x1000ULL * i; /* made-up page addresses */
        if (timestamps) timestamps[i] = 1700000000ULL + i;
    }
    *count = (unsigned)wanted;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, int cause, unsigned *count,
                                       unsigned long long *addresses) {
    return retired_pages(device, cause, count, addresses, NULL);
}

nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, int cause, unsigned *count,
                                          unsigned long long *addresses, unsigned long long *timestamps) {
    return retired_pages(device, cause, count, addresses, timestamps);
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *pending) {
    DEVICE_STATE(device, pending);
    if (!gpu.pages_supported) return NVML_ERROR_NOT_SUPPORTED;
    *pending = gpu.pages_pending ? 1 : 0;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------- PCIe */

#define PCIE_GETTER(function, member)                          \
    nvmlReturn_t function(nvmlDevice_t device, unsigned *out) { \
        DEVICE_STATE(device, out);                             \
        *out = (unsigned)gpu.member;                           \
        return NVML_SUCCESS;                                   \
    }

PCIE_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, pcie_gen)
PCIE_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, pcie_gen_max)
PCIE_GETTER(nvmlDeviceGetGpuMaxPcieLinkGeneration, pcie_gen_max)
PCIE_GETTER(nvmlDeviceGetCurrPcieLinkWidth, pcie_width)
PCIE_GETTER(nvmlDeviceGetMaxPcieLinkWidth, pcie_width_max)
PCIE_GETTER(nvmlDeviceGetPcieReplayCounter, pcie_replay)

/* ----------------------------------------------------------- NVLink */

/* Links past the GPU's own count (up to NVML_NVLINK_MAX_LINKS) are NOT_SUPPORTED, so a scan loop ends there. */
static nvmlReturn_t check_link(const struct fake_gpu *gpu, unsigned link) {
    if (link >= MAX_LINKS) return NVML_ERROR_INVALID_ARGUMENT;
    if ((int)link >= gpu->link_count) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned link, unsigned *active) {
    DEVICE_STATE(device, active);
    nvmlReturn_t rc = check_link(&gpu, link);
    if (rc == NVML_SUCCESS) *active = (unsigned)gpu.links[link].active;
    return rc;
}

nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned link, int counter,
                                             unsigned long long *value) {
    DEVICE_STATE(device, value);
    nvmlReturn_t rc = check_link(&gpu, link);
    if (rc != NVML_SUCCESS) return rc;
    switch (counter) {
    case 0: *value = gpu.links[link].replay_errors; break;   /* NVML_NVLINK_ERROR_DL_REPLAY */
    case 1: *value = gpu.links[link].recovery_errors; break; /* NVML_NVLINK_ERROR_DL_RECOVERY */
    case 2: *value = gpu.links[link].crc_errors; break;      /* NVML_NVLINK_ERROR_DL_CRC_FLIT */
    case 3:                                                  /* CRC data, ECC data: not modelled */
    case 4: *value = 0; break;
    default: return NVML_ERROR_INVALID_ARGUMENT;
    }
    return NVML_SUCCESS;
}
