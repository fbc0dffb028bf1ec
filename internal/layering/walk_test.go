package layering

import (
	"encoding/json"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
)

// A walk is what a reader does who follows one operation through the
// code: start at its entry points, read each function the first time it
// is named, in the order the code names them, and go back to the caller
// when done. Only the module's own, concrete functions are followed: a
// call through an interface ends the walk there, as it does for a reader
// who must then pick an implementation.
//
// A return is opening again a file the reader has left (it is not on
// the way back to an entry point) to read something not read yet there.
// A reader who opens a file reads a unit at once, as go doc groups them:
// a type's methods and constructors in that file, or one function. So
// coming back to a type already read is not a return; coming back for
// another free helper is. Issue 23 asked for few: each return is a reader
// paging back.
//
// Measured with this file (the baseline, 8582d3b, had no
// staging package: its entry points were checkpoint.(*Manager)...):
//
//	              functions  files  returns
//	save  8582d3b       192     27       23
//	save  a77b880       323     38       33
//	save  now           324     38       23
//	restore 8582d3b     156     23       19
//	restore a77b880     197     29       25
//	restore now         198     30       19

// walkCase names an operation and the functions where reading it starts.
type walkCase struct {
	name    string
	entries []string // "pkg/path.Func" or "pkg/path.(*T).Method", module-relative
	// ceiling is the most returns the walk may take. It is a ratchet:
	// lower it when a change lowers the count, so that the house cannot
	// quietly tangle again.
	ceiling int
}

var walks = []walkCase{
	{
		name: "drained save",
		entries: []string{
			"checkpoint/staging.(*Manager).BeginSave",
			"checkpoint/staging.(*Manager).CommitSave",
			"checkpoint/staging.(*Manager).drain",
		},
		ceiling: 23,
	},
	{
		name:    "restore",
		entries: []string{"checkpoint/staging.(*Manager).BeginRestore"},
		ceiling: 19,
	},
}

// TestWalk prints, for each operation, the files a reader visits and
// how often they page back, and fails when a count rises above its
// ceiling. Run with -v to see the walk, and WALK_TRACE=1 to see each
// return.
func TestWalk(t *testing.T) {
	prog := typeChecked(t)
	for _, wc := range walks {
		w, err := prog.walk(wc.entries)
		if err != nil {
			t.Fatalf("%s: %v", wc.name, err)
		}
		t.Logf("%s: %d functions in %d files; %d entries into a file left before, "+
			"%d of them to read a unit not read yet\n%s",
			wc.name, w.funcs, len(w.files), w.bounces, w.returns, w.describe())
		if os.Getenv("WALK_TRACE") != "" {
			t.Logf("%s returns:\n  %s", wc.name, strings.Join(w.why, "\n  "))
		}
		if w.returns > wc.ceiling {
			t.Errorf("%s: the walk returns to a file it left %d times; the ceiling is %d",
				wc.name, w.returns, wc.ceiling)
		}
	}
}

// TestFileLinks prints, for the packages issue 23 split, how many
// ordered pairs of their files are linked (the first names what the
// second declares), and how many of those have their reverse too (a link
// both ways counts as two).
func TestFileLinks(t *testing.T) {
	prog := typeChecked(t)
	for _, pkg := range []string{"checkpoint", "checkpoint/staging", "checkpoint/tiers"} {
		links, back := 0, 0
		for pair := range prog.links[pkg] {
			links++
			if prog.links[pkg][[2]string{pair[1], pair[0]}] {
				back++
			}
		}
		t.Logf("%s: %d links between its files, %d of them both ways", pkg, links, back)
	}
}

// loaded is the module type-checked once for all the tests that read it.
var loaded = sync.OnceValues(loadModule)

// typeChecked returns the module's program, or skips t with -short.
func typeChecked(t *testing.T) *program {
	t.Helper()
	if testing.Short() {
		t.Skip("type-checks the module")
	}
	prog, err := loaded()
	if err != nil {
		t.Fatal(err)
	}
	return prog
}

// program is the module's packages, type-checked from source, with every
// concrete function declaration indexed by its object.
type program struct {
	fset  *token.FileSet
	decls map[*types.Func]funcDecl
	byKey map[string]*types.Func
	links map[string]map[[2]string]bool // package → file pairs: the first names what the second declares
}

type funcDecl struct {
	decl *ast.FuncDecl
	file string // module-relative path
	info *types.Info
}

type listed struct {
	ImportPath string
	Dir        string
	GoFiles    []string
	Export     string
	Module     *struct{ Path string }
}

// loadModule type-checks the packages the daemon is built from. Packages
// outside the module come from the compiler's export data (go list
// -export), so only the module itself is parsed.
func loadModule() (*program, error) {
	cmd := exec.Command("go", "list", "-deps", "-export",
		"-json=ImportPath,Dir,GoFiles,Export,Module", "./cmd/ckptd")
	cmd.Dir = "../.."
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list: %w", err)
	}
	pkgs := map[string]listed{}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p listed
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			return nil, err
		}
		pkgs[p.ImportPath] = p
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		return nil, err
	}
	l := &loader{
		prog: &program{fset: token.NewFileSet(), decls: map[*types.Func]funcDecl{},
			byKey: map[string]*types.Func{}, links: map[string]map[[2]string]bool{}},
		pkgs:    pkgs,
		root:    root,
		checked: map[string]*types.Package{},
	}
	l.export = importer.ForCompiler(l.prog.fset, "gc", func(path string) (io.ReadCloser, error) {
		p, ok := pkgs[path]
		if !ok || p.Export == "" {
			return nil, fmt.Errorf("no export data for %s", path)
		}
		return os.Open(p.Export)
	})
	for path, p := range pkgs {
		if inModule(p) {
			if _, err := l.Import(path); err != nil {
				return nil, err
			}
		}
	}
	return l.prog, nil
}

func inModule(p listed) bool { return p.Module != nil && p.Module.Path+"/" == module }

type loader struct {
	prog    *program
	pkgs    map[string]listed
	root    string
	export  types.Importer
	checked map[string]*types.Package
}

func (l *loader) Import(path string) (*types.Package, error) {
	if tp, ok := l.checked[path]; ok {
		return tp, nil
	}
	p, ok := l.pkgs[path]
	if !ok || !inModule(p) {
		return l.export.Import(path)
	}
	var files []*ast.File
	for _, name := range p.GoFiles {
		f, err := parser.ParseFile(l.prog.fset, filepath.Join(p.Dir, name), nil, 0)
		if err != nil {
			return nil, err
		}
		files = append(files, f)
	}
	info := &types.Info{Uses: map[*ast.Ident]types.Object{}, Defs: map[*ast.Ident]types.Object{}}
	conf := types.Config{Importer: l}
	tp, err := conf.Check(path, l.prog.fset, files, info)
	if err != nil {
		return nil, fmt.Errorf("type-check %s: %w", path, err)
	}
	l.checked[path] = tp
	l.index(tp, files, info)
	return tp, nil
}

// index records every function and method declared in the package's files.
func (l *loader) index(tp *types.Package, files []*ast.File, info *types.Info) {
	for _, f := range files {
		rel, _ := filepath.Rel(l.root, l.prog.fset.File(f.Pos()).Name())
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			fn, ok := info.Defs[fd.Name].(*types.Func)
			if !ok {
				continue
			}
			l.prog.decls[fn] = funcDecl{decl: fd, file: rel, info: info}
			l.prog.byKey[funcKey(fn)] = fn
		}
	}
	l.indexLinks(tp, info)
}

// indexLinks records which of the package's files name what another of
// its files declares at package level.
func (l *loader) indexLinks(tp *types.Package, info *types.Info) {
	links := map[[2]string]bool{}
	for id, obj := range info.Uses {
		if obj.Pkg() != tp || !declaredAtTop(obj) {
			continue
		}
		from := l.prog.fset.File(id.Pos()).Name()
		to := l.prog.fset.File(obj.Pos()).Name()
		if from != to {
			links[[2]string{filepath.Base(from), filepath.Base(to)}] = true
		}
	}
	l.prog.links[strings.TrimPrefix(tp.Path(), module)] = links
}

// declaredAtTop reports whether obj is a package-level name, or a method
// or field (declared with its type).
func declaredAtTop(obj types.Object) bool {
	if obj.Parent() == obj.Pkg().Scope() {
		return true
	}
	switch o := obj.(type) {
	case *types.Func:
		return o.Type().(*types.Signature).Recv() != nil
	case *types.Var:
		return o.IsField()
	}
	return false
}

// funcKey names fn as the walk cases do: module-relative package path,
// then the function, or the method with its receiver.
func funcKey(fn *types.Func) string {
	full := fn.FullName() // "path.Func" or "(*path.T).Method"
	return strings.ReplaceAll(full, module, "")
}

// walked is the result of one walk.
type walked struct {
	funcs   int
	files   []string       // in the order first entered
	bounces int            // entries into a file left before, function by function
	returns int            // those that open a unit not read yet
	back    map[string]int // returns per file
	why     []string       // each return: into which file, from which, for what
}

// unitOf is what a reader reads at once when opening fn's file, much as
// go doc groups it: a method, or a function whose first result is one of
// the package's types (a constructor), belongs to that type, and the
// type's methods in that file are read together; any other function
// stands alone. (go doc also groups a function by a later result, or a
// slice of the type; the walk does not.)
func unitOf(fn *types.Func) types.Object {
	sig := fn.Type().(*types.Signature)
	if recv := sig.Recv(); recv != nil {
		if n := namedOf(recv.Type()); n != nil {
			return n.Obj()
		}
		return fn
	}
	if sig.Results().Len() > 0 {
		if n := namedOf(sig.Results().At(0).Type()); n != nil && n.Obj().Pkg() == fn.Pkg() {
			return n.Obj()
		}
	}
	return fn
}

func namedOf(t types.Type) *types.Named {
	if p, ok := t.(*types.Pointer); ok {
		t = p.Elem()
	}
	n, _ := t.(*types.Named)
	return n
}

// walker is one reader's state.
type walker struct {
	p      *program
	w      *walked
	seen   map[*types.Func]bool
	read   map[unit]bool
	everIn map[string]bool
	stack  []string // the files the reader is in the middle of
}

type unit struct {
	file string
	obj  types.Object
}

func (p *program) walk(entries []string) (*walked, error) {
	r := &walker{p: p, w: &walked{back: map[string]int{}}, seen: map[*types.Func]bool{},
		read: map[unit]bool{}, everIn: map[string]bool{}}
	for _, e := range entries {
		fn, ok := p.byKey[keyFromCase(e)]
		if !ok {
			return nil, fmt.Errorf("no function %s", e)
		}
		if !r.seen[fn] {
			r.visit(fn)
		}
	}
	return r.w, nil
}

func (r *walker) visit(fn *types.Func) {
	d := r.p.decls[fn]
	r.seen[fn] = true
	r.w.funcs++
	r.enter(d.file, fn)
	r.stack = append(r.stack, d.file)
	for _, callee := range r.p.callees(d) {
		if !r.seen[callee] {
			r.visit(callee)
		}
	}
	r.stack = r.stack[:len(r.stack)-1]
}

// enter opens file to read fn, counting a return when the reader had
// left the file and has not read fn's unit there.
func (r *walker) enter(file string, fn *types.Func) {
	left := r.everIn[file] && !slices.Contains(r.stack, file)
	u := unit{file, unitOf(fn)}
	if left {
		r.w.bounces++
	}
	if left && !r.read[u] {
		r.w.returns++
		r.w.back[file]++
		from := "(entry)"
		if len(r.stack) > 0 {
			from = r.stack[len(r.stack)-1]
		}
		r.w.why = append(r.w.why, fmt.Sprintf("%s <- %s: %s", file, from, funcKey(fn)))
	}
	if !r.everIn[file] {
		r.w.files = append(r.w.files, file)
	}
	r.everIn[file] = true
	r.read[u] = true
}

// keyFromCase turns "pkg.(*T).M" into the form funcKey gives: "(*pkg.T).M".
func keyFromCase(e string) string {
	if i := strings.Index(e, ".("); i >= 0 {
		pkg, rest := e[:i], e[i+2:] // rest: "*T).M"
		star := strings.HasPrefix(rest, "*")
		rest = strings.TrimPrefix(rest, "*")
		if star {
			return "(*" + pkg + "." + rest
		}
		return "(" + pkg + "." + rest
	}
	return e
}

// callees lists the module's concrete functions that d names (calls or
// takes as values), in the order it names them, each once.
func (p *program) callees(d funcDecl) []*types.Func {
	var out []*types.Func
	once := map[*types.Func]bool{}
	ast.Inspect(d.decl.Body, func(n ast.Node) bool {
		id, ok := n.(*ast.Ident)
		if !ok {
			return true
		}
		fn, ok := d.info.Uses[id].(*types.Func)
		if !ok {
			return true
		}
		fn = fn.Origin()
		if _, concrete := p.decls[fn]; concrete && !once[fn] {
			once[fn] = true
			out = append(out, fn)
		}
		return true
	})
	return out
}

// describe lists the files in the order first entered, with how often the
// walk came back to each.
func (w *walked) describe() string {
	var b strings.Builder
	for _, f := range w.files {
		fmt.Fprintf(&b, "  %-40s %d\n", f, w.back[f])
	}
	return b.String()
}
