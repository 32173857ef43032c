/* corral-tar: write a directory tree to stdout as a POSIX (pax) tar, for the host.
 *
 * Runs inside a microVM guest (static, from the initramfs at /.corral/tar) to stream the
 * guest overlay's upper dir out through the agent when the node snapshots the VM: the
 * host never mounts or walks a guest filesystem. busybox tar cannot do this: it keeps no
 * xattrs, and the upper's opaque directories are marked by trusted.overlay.opaque.
 *
 * What it writes, for every entry below DIR (DIR itself is not an entry), names relative
 * to DIR, parents before children:
 *   - directories, regular files, symlinks, char/block devices (overlay whiteouts are
 *     char 0:0), fifos; sockets are skipped (they mean nothing in a layer);
 *   - a second name of a regular file already written is a hardlink entry;
 *   - a pax header ('x') when a name or link target is too long for ustar, a size or id
 *     too big for its field, or the entry has xattrs (SCHILY.xattr.NAME=VALUE, binary).
 * A regular file is written with the size lstat saw: cut if it grew, zero-filled if it
 * shrank while being read (the guest runs on during a snapshot).
 *
 * Usage: corral-tar DIR     exit 0, or 1 with "corral-tar: ..." on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

static size_t root_len;
static char *pax;       /* the pax records of the current entry */
static size_t pax_len, pax_cap;

struct link { dev_t dev; ino_t ino; char *name; };
static struct link *links;
static size_t nlinks, links_cap;

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("corral-tar: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void *xrealloc(void *p, size_t n)
{
    p = realloc(p, n);
    if (!p) die("out of memory");
    return p;
}

static void out(const void *p, size_t n)
{
    if (n && fwrite(p, 1, n, stdout) != n) die("write: %s", strerror(errno));
}

static void pad(uint64_t n)
{
    static const char zero[512];
    if (n % 512) out(zero, 512 - n % 512);
}

/* One pax record "LEN key=value\n", LEN counting itself. */
static void pax_add(const char *key, const char *val, size_t vlen)
{
    size_t base = strlen(key) + vlen + 3, len = base + 1, digits;
    for (;;) {
        char tmp[24];
        digits = (size_t)snprintf(tmp, sizeof tmp, "%zu", len);
        if (base + digits == len) break;
        len = base + digits;
    }
    if (pax_len + len + 1 > pax_cap) {
        pax_cap = (pax_len + len + 1) * 2;
        pax = xrealloc(pax, pax_cap);
    }
    int n = sprintf(pax + pax_len, "%zu %s=", len, key);
    memcpy(pax + pax_len + n, val, vlen);
    pax[pax_len + n + vlen] = '\n';
    pax_len += len;
}

static void pax_num(const char *key, uint64_t v)
{
    char s[24];
    int n = snprintf(s, sizeof s, "%llu", (unsigned long long)v);
    pax_add(key, s, (size_t)n);
}

static void octal(char *field, size_t width, uint64_t v)
{
    /* width-1 digits and a NUL; callers put v in the pax header when it does not fit */
    snprintf(field, width, "%0*llo", (int)width - 1, (unsigned long long)v);
}

static void header(const char *name, const struct stat *st, char type, uint64_t size,
                   const char *target)
{
    char h[512];
    memset(h, 0, sizeof h);
    strncpy(h, name, 100);
    octal(h + 100, 8, st->st_mode & 07777);
    octal(h + 108, 8, st->st_uid < 010000000 ? st->st_uid : 0);
    octal(h + 116, 8, st->st_gid < 010000000 ? st->st_gid : 0);
    octal(h + 124, 12, size < 077777777777ULL ? size : 0);
    octal(h + 136, 12, st->st_mtime > 0 && st->st_mtime < 077777777777LL ? st->st_mtime : 0);
    h[156] = type;
    if (target) strncpy(h + 157, target, 100);
    memcpy(h + 257, "ustar", 6);
    memcpy(h + 263, "00", 2);
    if (type == '3' || type == '4') {
        octal(h + 329, 8, major(st->st_rdev) & 07777777);
        octal(h + 337, 8, minor(st->st_rdev) & 07777777);
    }
    memset(h + 148, ' ', 8);
    unsigned sum = 0;
    for (int i = 0; i < 512; i++) sum += (unsigned char)h[i];
    snprintf(h + 148, 8, "%06o", sum);
    h[155] = ' ';
    out(h, 512);
}

static void xattrs(const char *path)
{
    char names[8192], val[65536], key[300];
    ssize_t n = llistxattr(path, names, sizeof names);
    if (n < 0) {
        if (errno == ENOTSUP) return;
        die("listxattr %s: %s", path, strerror(errno));
    }
    for (char *k = names; k < names + n; k += strlen(k) + 1) {
        ssize_t v = lgetxattr(path, k, val, sizeof val);
        if (v < 0) {
            if (errno == ENODATA) continue;  /* removed meanwhile */
            die("getxattr %s %s: %s", path, k, strerror(errno));
        }
        if (snprintf(key, sizeof key, "SCHILY.xattr.%s", k) >= (int)sizeof key) continue;
        pax_add(key, val, (size_t)v);
    }
}

static void copy_file(const char *path, uint64_t size)
{
    static char buf[1 << 16];
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) die("open %s: %s", path, strerror(errno));
    uint64_t done = 0;
    while (done < size) {
        size_t want = size - done < sizeof buf ? (size_t)(size - done) : sizeof buf;
        ssize_t r = read(fd, buf, want);
        if (r < 0) {
            if (errno == EINTR) continue;
            die("read %s: %s", path, strerror(errno));
        }
        if (r == 0) {  /* shrank: fill with zeros to the size in the header */
            memset(buf, 0, sizeof buf);
            while (done < size) {
                size_t z = size - done < sizeof buf ? (size_t)(size - done) : sizeof buf;
                out(buf, z);
                done += z;
            }
            break;
        }
        out(buf, (size_t)r);
        done += (uint64_t)r;
    }
    close(fd);
    pad(size);
}

static int visit(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)ftw;
    if (strlen(path) <= root_len) return 0;  /* DIR itself */
    if (flag == FTW_DNR || flag == FTW_NS) die("cannot read %s", path);
    const char *rel = path + root_len + 1;
    char name[4096 + 2];
    char target[4096 + 1];
    const char *link_target = NULL;
    char type;
    uint64_t size = 0;
    if (snprintf(name, sizeof name, "%s%s", rel, S_ISDIR(st->st_mode) ? "/" : "")
        >= (int)sizeof name)
        die("name too long: %s", path);
    pax_len = 0;
    if (S_ISREG(st->st_mode)) {
        type = '0';
        size = (uint64_t)st->st_size;
        if (st->st_nlink > 1) {
            for (size_t i = 0; i < nlinks; i++)
                if (links[i].dev == st->st_dev && links[i].ino == st->st_ino) {
                    type = '1';
                    link_target = links[i].name;
                    size = 0;
                    break;
                }
            if (type == '0') {
                if (nlinks == links_cap) {
                    links_cap = links_cap ? links_cap * 2 : 64;
                    links = xrealloc(links, links_cap * sizeof *links);
                }
                links[nlinks].dev = st->st_dev;
                links[nlinks].ino = st->st_ino;
                links[nlinks].name = strdup(name);
                if (!links[nlinks].name) die("out of memory");
                nlinks++;
            }
        }
    } else if (S_ISDIR(st->st_mode)) {
        type = '5';
    } else if (S_ISLNK(st->st_mode)) {
        type = '2';
        ssize_t n = readlink(path, target, sizeof target - 1);
        if (n < 0) die("readlink %s: %s", path, strerror(errno));
        target[n] = 0;
        link_target = target;
    } else if (S_ISCHR(st->st_mode)) {
        type = '3';
    } else if (S_ISBLK(st->st_mode)) {
        type = '4';
    } else if (S_ISFIFO(st->st_mode)) {
        type = '6';
    } else {
        return 0;  /* a socket */
    }
    if (strlen(name) > 100) pax_add("path", name, strlen(name));
    if (link_target && strlen(link_target) > 100)
        pax_add("linkpath", link_target, strlen(link_target));
    if (size >= 077777777777ULL) pax_num("size", size);
    if (st->st_uid >= 010000000) pax_num("uid", st->st_uid);
    if (st->st_gid >= 010000000) pax_num("gid", st->st_gid);
    if (type != '1' && type != '2') xattrs(path);
    if (pax_len) {
        struct stat ps = *st;
        ps.st_mode = 0644;
        header("PaxHeader", &ps, 'x', pax_len, NULL);
        out(pax, pax_len);
        pad(pax_len);
    }
    header(name, st, type, size, link_target);
    if (type == '0') copy_file(path, size);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) die("usage: corral-tar DIR");
    char *root = argv[1];
    root_len = strlen(root);
    while (root_len > 1 && root[root_len - 1] == '/') root[--root_len] = 0;
    static char obuf[1 << 16];
    setvbuf(stdout, obuf, _IOFBF, sizeof obuf);
    if (nftw(root, visit, 64, FTW_PHYS | FTW_MOUNT) != 0) die("walk %s: %s", root, strerror(errno));
    char end[1024];
    memset(end, 0, sizeof end);
    out(end, sizeof end);
    if (fflush(stdout) != 0) die("write: %s", strerror(errno));
    return 0;
}
