// gwtf-hello: the smallest useful libgwtf program in Go.
package main

import (
	"fmt"
	"os"

	"libgwtf.local/gwtf"
)

func main() {
	fmt.Printf("libgwtf %s (ABI %d, header ABI %d)\n", gwtf.Version(), gwtf.ABIVersion(), gwtf.HeaderABIVersion)
	if err := gwtf.CheckABI(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if _, err := gwtf.ProbeCUDA(gwtf.ProbeDetail(7)); err != nil {
		fmt.Printf("probe with detail=7: status %d (%v): %v\n", gwtf.StatusOf(err), gwtf.StatusOf(err), err)
	}
	info, err := gwtf.ProbeCUDA(gwtf.ProbeDevices)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer info.Close()
	text, _ := info.Describe()
	state, _ := info.State()
	devices, _ := info.Devices()
	fmt.Printf("cuda: %s\ncuda state %v, %d device(s)\n", text, state, len(devices))
	for _, d := range devices {
		fmt.Printf("  device %d: %s, %d MiB\n", d.Ordinal, d.Name, d.TotalMemoryBytes>>20)
	}
	fmt.Println("gwtf-hello: ok")
}
