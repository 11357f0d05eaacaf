/* Drives the simulator (dlopen'ed) through two interleavings, made deterministic by pausing a
   thread inside the simulator at its first mutex unlock/lock (this program interposes them).
   mode "setdevice": aclrtSetDevice(0) pauses after it has found device 0's default context; the
   device's last reset releases that context and an aclrtCreateContext on device 1 reuses its
   struct; the paused thread's current context must not become device 1's context.
   mode "fork": a thread pauses holding the simulator's first lock of aclrtCreateContext (the
   spare contexts' list); the process forks; the child's aclInit + aclrtSetDevice must not hang.
   Exit 0: right; 1: the defect; 2: setup failure. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int (*mfn)(pthread_mutex_t *);
static mfn real_lock, real_unlock;
static __thread int pause_after_unlock, pause_after_lock;

__attribute__((constructor)) static void resolve(void)
{
    real_lock = (mfn)dlsym(RTLD_NEXT, "pthread_mutex_lock");
    real_unlock = (mfn)dlsym(RTLD_NEXT, "pthread_mutex_unlock");
}
int pthread_mutex_lock(pthread_mutex_t *m)
{
    int rc = real_lock(m);
    if (pause_after_lock) { pause_after_lock = 0; usleep(600000); }
    return rc;
}
int pthread_mutex_unlock(pthread_mutex_t *m)
{
    int rc = real_unlock(m);
    if (pause_after_unlock) { pause_after_unlock = 0; usleep(300000); }
    return rc;
}

typedef int (*i_v)(void);
typedef int (*i_p)(const char *);
typedef int (*i_i)(int);
typedef int (*i_pp_i)(void **, int);
typedef int (*i_pp)(void **);
typedef int (*i_ptr)(void *);
typedef int (*i_pi)(int *);
static i_p aclInit; static i_i SetDevice, ResetDevice; static i_pp_i CreateContext;
static i_pp GetCurrentContext; static i_ptr SetCurrentContext; static i_pi GetDevice;

static void *h_b;
static int rc_b = -1, dev_b = -1;
static void *thread_b(void *arg)
{
    (void)arg;
    pause_after_unlock = 1;           /* pauses right after sim_default_context() let go of d->lock */
    rc_b = SetDevice(0);
    pause_after_unlock = 0;
    if (rc_b == 0 && GetCurrentContext(&h_b) == 0 && h_b && SetCurrentContext(h_b) == 0)
        GetDevice(&dev_b);
    return NULL;
}

static void *thread_t(void *arg)
{
    (void)arg;
    void *c;
    pause_after_lock = 1;             /* holds context_new's spare list lock for 600 ms */
    CreateContext(&c, 0);
    pause_after_lock = 0;
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 3) return 2;
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 2; }
#define SYM(v, t, n) if (!(v = (t)dlsym(lib, n))) return 2
    SYM(aclInit, i_p, "aclInit"); SYM(SetDevice, i_i, "aclrtSetDevice"); SYM(ResetDevice, i_i, "aclrtResetDevice");
    SYM(CreateContext, i_pp_i, "aclrtCreateContext"); SYM(GetCurrentContext, i_pp, "aclrtGetCurrentContext");
    SYM(SetCurrentContext, i_ptr, "aclrtSetCurrentContext"); SYM(GetDevice, i_pi, "aclrtGetDevice");
    if (aclInit(NULL) != 0 || SetDevice(0) != 0) return 2;
    pthread_t t;
    if (strcmp(argv[2], "setdevice") == 0) {
        pthread_create(&t, NULL, thread_b, NULL);
        usleep(100000);
        if (ResetDevice(0) != 0) return 2;            /* the last reference: the context is released */
        void *x;
        if (CreateContext(&x, 1) != 0) return 2;      /* device 1's context, perhaps in its struct */
        pthread_join(t, NULL);
        printf("setdevice: rc %d, thread's context %p (device %d), device 1's new context %p\n", rc_b, h_b, dev_b, x);
        return (rc_b == 0 && (h_b == x || dev_b != 0)) ? 1 : 0;
    }
    if (strcmp(argv[2], "fork") == 0) {
        pthread_create(&t, NULL, thread_t, NULL);
        usleep(150000);
        pid_t pid = fork();
        if (pid == 0) {
            alarm(5);
            int a = aclInit(NULL), b = SetDevice(0);
            _exit(a == 0 && b == 0 ? 0 : 3);
        }
        int st;
        waitpid(pid, &st, 0);
        pthread_join(t, NULL);
        printf("fork: child %s %d\n", WIFSIGNALED(st) ? "killed by signal" : "exit", WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
        return WIFSIGNALED(st) ? 1 : (WEXITSTATUS(st) == 0 ? 0 : 2);
    }
    return 2;
}
