/* The KVM probe's guest (cua_rollout/vm/kvm.py): a 512-byte boot sector that walks the path a
   kernel takes and reports each step on the serial port (COM1): R real mode, T timer
   interrupts delivered (3 BIOS ticks), P protected mode, L long mode, C a 2^26-iteration loop
   finished (well under a second on any working accelerator).
   Build: as --64 -o p.o kvm_probe.S && ld -Ttext 0 --oformat binary -o p.bin p.o */
.code16
.globl _start
_start:
    cli
    xorw %ax, %ax
    movw %ax, %ds
    movw %ax, %ss
    movw $0x7c00, %sp
    movw $0x3f8, %dx
    movb $'R', %al
    outb %al, %dx
    /* timer interrupts: wait for 3 BIOS ticks (PIT IRQ0, 18.2 Hz) with sti; hlt */
    sti
    movw 0x46c, %bx
    addw $3, %bx
2:  hlt
    cmpw %bx, 0x46c
    jb 2b
    cli
    movb $'T', %al
    outb %al, %dx
    lgdtl gdt_desc - _start + 0x7c00
    movl %cr0, %eax
    orl $1, %eax
    movl %eax, %cr0
    ljmpl $0x08, $(pm - _start + 0x7c00)
.code32
pm:
    movw $0x10, %ax
    movw %ax, %ds
    movw %ax, %es
    movw %ax, %ss
    movw $0x3f8, %dx
    movb $'P', %al
    outb %al, %dx
    /* page tables: PML4 at 0x1000 -> PDPT 0x2000 -> PD 0x3000, one 2 MiB identity page */
    movl $0x1000, %edi
    xorl %eax, %eax
    movl $0xc00, %ecx
    rep stosl
    movl $0x2003, 0x1000
    movl $0x3003, 0x2000
    movl $0x83, 0x3000
    movl $0x1000, %eax
    movl %eax, %cr3
    movl %cr4, %eax
    orl $0x20, %eax
    movl %eax, %cr4
    movl $0xc0000080, %ecx
    rdmsr
    orl $0x100, %eax
    wrmsr
    movl %cr0, %eax
    orl $0x80000000, %eax
    movl %eax, %cr0
    ljmpl $0x18, $(lm - _start + 0x7c00)
.code64
lm:
    movw $0x3f8, %dx
    movb $'L', %al
    outb %al, %dx
    /* compute: 2^26 iterations of a multiply */
    movl $0x4000000, %ecx
    movq $1, %rax
3:  imulq $3, %rax
    decl %ecx
    jnz 3b
    movb $'C', %al
    outb %al, %dx
    movb $'\n', %al
    outb %al, %dx
1:  hlt
    jmp 1b
.balign 8
gdt:
    .quad 0
    .quad 0x00cf9a000000ffff   /* 0x08 code32 */
    .quad 0x00cf92000000ffff   /* 0x10 data */
    .quad 0x00af9a000000ffff   /* 0x18 code64 */
gdt_desc:
    .word gdt_desc - gdt - 1
    .long gdt - _start + 0x7c00
.org 510
.byte 0x55, 0xaa
